"""Random-weight models of real shapes, seeded, for speed work and tests (no download)."""
from __future__ import annotations

import torch

from llmaccel.compiler.families import weight_shapes
from llmaccel.config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(family="llama", vocab_size=512, hidden_size=64, n_layers=2, n_heads=4,
                              n_kv_heads=2, head_dim=16, intermediate_size=128, norm_eps=1e-5,
                              max_position=512, rope_theta=10000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64},
                              bos_token_id=1, eos_token_id=2),
    "tiny-gpt2": ModelConfig(family="gpt2", model_type="gpt2", vocab_size=512, hidden_size=64,
                             n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, intermediate_size=256,
                             max_position=512, tie_word_embeddings=True, hidden_act="gelu_new",
                             bos_token_id=0, eos_token_id=0),
    "smollm2-135m": ModelConfig(family="llama", vocab_size=49152, hidden_size=576, n_layers=30,
                                n_heads=9, n_kv_heads=3, head_dim=64, intermediate_size=1536,
                                norm_eps=1e-5, max_position=8192, tie_word_embeddings=True,
                                rope_theta=100000.0, bos_token_id=1, eos_token_id=2),
    "llama-1b": ModelConfig(family="llama", vocab_size=128256, hidden_size=2048, n_layers=16,
                            n_heads=32, n_kv_heads=8, head_dim=64, intermediate_size=8192,
                            norm_eps=1e-5, max_position=131072, tie_word_embeddings=True,
                            rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE),
                            bos_token_id=128000, eos_token_id=128001),
    "llama2-7b": ModelConfig(family="llama", vocab_size=32000, hidden_size=4096, n_layers=32,
                             n_heads=32, n_kv_heads=32, head_dim=128, intermediate_size=11008,
                             norm_eps=1e-5, max_position=4096, rope_theta=10000.0,
                             bos_token_id=1, eos_token_id=2),
}
# Tiny models use larger weights than 0.02 so that their next-token distributions are peaked
# and greedy decoding does not hinge on rounding-level ties.
_STD = {"tiny-llama": 0.15, "tiny-gpt2": 0.15}


def preset_weights(name: str, dtype: torch.dtype = torch.float32, device="cpu",
                   seed: int = 0) -> dict[str, torch.Tensor]:
    return random_weights(PRESETS[name], std=_STD.get(name, 0.02), dtype=dtype, device=device, seed=seed)


def random_weights(cfg: ModelConfig, *, std: float = 0.02, dtype: torch.dtype = torch.float32,
                   device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights for every tensor of cfg's canonical model."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for wname, shape in weight_shapes(cfg).items():
        t = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
        if "norm" in wname and wname.endswith("weight"):
            t = 1.0 + 0.1 * t  # norm scales near one, but not one, so folding them is tested
        elif wname.endswith("bias"):
            t = 0.02 * t
        else:
            t = std * t
        out[wname] = t.to(dtype)
    return out
