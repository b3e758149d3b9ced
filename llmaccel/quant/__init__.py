"""Weight-quantization algorithms used by the `quant` pass (llmaccel/passes/quant.py)."""
from llmaccel.quant.algorithms import Grid, awq_clip, awq_scale, gptq, refit_scales, source_correct

__all__ = ["Grid", "awq_clip", "awq_scale", "gptq", "refit_scales", "source_correct"]
