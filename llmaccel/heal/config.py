"""heal's options (HealConfig) and how their auto values resolve for a device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.fx

from llmaccel.errors import LlmaccelError
from llmaccel.ir import op_nodes
from llmaccel.ops.sla import linear_attention
from llmaccel.passes.base import PassContext

# heal.refresh's auto count: more windows than a 10-minute heal receives. In a process of its own
# the engine samples ~43,000 tokens/s beside an H200 heal: 32,768 windows of 481 new tokens ran
# out after ~6 minutes of a 6.5-minute gqa heal (2026-12-04); 65,536 hold ~12 minutes, in a
# pool of 270 MB of token ids on the device.
_REFRESH_AUTO = 65536


@dataclass
class HealConfig:
    # On a CPU a SmolLM2-135M step of 2 x 64 tokens takes ~1.2 s on an idle 2-core machine
    # (measured 2026-12-03), so the 40 default steps take under a minute: a smoke test, not a
    # heal. On a GPU use thousands of steps or a `minutes` budget (scripts/gpu_heal.sh).
    steps: int = 40
    lr: float = 5e-4
    seq_len: int = 0         # tokens per window; 0 = 512 on CUDA, 64 elsewhere
    batch: int = 0           # windows per step; 0 = ~16k tokens per step on CUDA (fewer if memory
                             # is short), 2 elsewhere
    # Weight of the final hidden state's normalised MSE beside the KL (0 = KL only). At 1, a
    # 6.5-minute H100 heal of gqa to one KV head moved each domain by 1 point at most.
    hidden: float = 0.0
    embed: bool = False      # also train the token embedding / LM head (large, usually not needed)
    # Which of those weights train: all, or changed: only the ones the earlier passes changed
    # or added (a weight equal to the source's of the same name stays frozen: after gqa, the
    # attention's projections train and the MLPs and norms keep the source's values). On a CPU
    # heal of 38k tokens it beat `all` after gqa on every domain and lost after relu, whose gates
    # must move too; in a 6.5-minute H100 heal of gqa (47 M tokens) it lost on every domain
    # (docs/quality.md).
    train: Literal["all", "changed"] = "all"
    eval_windows: int = 8    # held-out calibration windows for the before/after measurement
    warmup: int = 2          # linear warm-up steps, then cosine decay to lr/10
    # Wall-clock budget (0 = none): training progress is the larger of step/steps and the
    # elapsed share of the budget, so the lr decay and the passes' schedules still complete when
    # time runs out. The first step (which compiles) counts against the budget but not the share.
    minutes: float = 0.0
    # Training windows sampled from the source model by the engine (`temperature`, `top_p`),
    # added to the calibration windows. A file's worth of windows is seen many times in a long
    # heal and the student starts to fit those windows rather than the source; samples are as
    # many fresh windows as one asks for. -1 = auto: 2048 on CUDA when the engine's sampler is at
    # hand (about 70 s of an H200 before training starts; a heal on calibration windows alone fits
    # their domain: gqa to one KV head +33% on wikitext2 and +98% on other text, against +17%
    # and +45-51% with them), unless `refresh` samples in a process of its own, which delivers
    # thousands of windows while the first step compiles; 0 elsewhere (a 2-core CPU samples a
    # few tokens a second).
    sampled: int = -1
    # What the sampled windows continue: calib, the first 32 tokens of calibration windows;
    # mixed, `calib_share` of those and the rest built-in openings of code, dialogue,
    # instructions, documentation and lists (eval/prompts.py); auto: mixed when the model has a
    # tokenizer.
    prompts: Literal["auto", "calib", "mixed"] = "auto"
    # mixed: the share of prompts that open with calibration text (the rest: built-in openings).
    # The evaluation domains other than wikitext2 are not among the calibration text's. gqa to one
    # KV head, 6.5-minute heals on an H100 (2026-12-05/06): 0.5 ended wikitext2 / code / docs
    # +15.2% / +33.7% / +27.4%, 0.25 +15.8% / +24.8% / +20.2%.
    calib_share: float = 0.25
    # How the engine samples those windows: its temperature and top-p (nucleus) filter. Unfiltered
    # by default: a gqa heal to one KV head with top_p=0.9 (H200, 2026-12-05) ended better on
    # wikitext2 (+12.5% against +15%) but worse on docs (+36.9% against +27.5%); a hotter
    # sampler (temperature 1.2, H100, 2026-12-06) was worse on all: code +38.2% against +24.8%.
    temperature: float = 1.0
    top_p: float = 1.0
    # Windows the engine samples while training runs (sharing the device), trained on as they
    # arrive, fresh ones first: a heal that goes over its windows many times fits them rather
    # than the source (data.WindowPool). 0 = none; -1 = auto: _REFRESH_AUTO on CUDA with
    # the engine's sampler when the heal would go round its windows (a `minutes` budget, or more
    # steps x batch than windows; sampling stops with training; a 6-minute H200 heal of gqa to one
    # KV head used 16,384 of them: ΔPPL on code +50% -> +35%, docs +45% -> +31%), 0 elsewhere.
    refresh: int = -1
    # Where the engine samples those windows: on a thread of this process, or in a process of its
    # own that loads the source model again from its source and samples from the start (a thread
    # waits for the first step's compilation, whose Python it would slow down). On a thread its
    # Python loop shares the interpreter with the training step's kernel launches. Alone on an
    # H200, relu heals (2026-12-04): thread 102,000 training tokens/s steady beside 28,000
    # sampled; process 124,000 beside 42,000; no sampler at all 235,000. auto: process on CUDA,
    # thread elsewhere (a 2-core CPU has no core to spare for a second copy of the model).
    refresh_in: Literal["auto", "thread", "process"] = "auto"
    # Sequences the engine samples at once (its max_num_seqs; 0 = auto: 256 on CUDA, 16
    # elsewhere). Its KV cache holds that many whole windows beside the heal's own memory:
    # SmolLM2 at 513 tokens in bf16 peaked at 3.6 GiB with 256 and 12.7 GiB with 1,024. Alone on
    # an H100 (2026-12-05, a warm process, four batches each) 1,024 sampled 114,000 tokens/s
    # against 58,600 for 256; beside a training step, where the two share the GPU, not measured.
    sample_batch: int = 0
    seed: int = 0            # seeds the sampled windows and the order of training windows
    # Quality on every evaluation domain (eval/domains.py) against the source: the first
    # domain_tokens predicted tokens of each (0: not measured), before the heal, at domain_evals
    # evenly spaced points of training progress, and after. -1 = auto: 2048 tokens and 4 points
    # on CUDA; 512 and 1 elsewhere (on a 2-core CPU one SmolLM2 measurement of 3 x 512 tokens
    # costs about as much as two training steps).
    domain_tokens: int = -1
    domain_evals: int = -1
    # bfloat16: autocast with fp32 master weights; float32: the weights' dtype, TF32 matmuls.
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # torch.compile backend of the forwards (auto: inductor on CUDA, off elsewhere)
    compile: Literal["auto", "off", "inductor", "aot_eager"] = "auto"
    # Compile each decoder layer once and reuse it for the alike layers (regions.py: nested
    # compile regions) instead of the whole graph. 2-core CPU, SmolLM2-135M shapes, Inductor:
    # first step 80 -> 39 s but later steps ~10% slower; sla 190 -> 62 s, later steps no slower.
    # auto: on for graphs with linear attention (sla), whose whole graph compiles slowest: on an
    # H100, sla with a window 185 -> 110 s, steps as fast (91,300 against 91,800 tok/s), so a
    # 6.5-minute heal trained 25.6 M tokens against 18.8 M; off otherwise: on an H200 (gqa) the
    # first step was no faster (65 s) and later steps ~27% slower (91,200 tok/s against 124,200+;
    # docs/quality.md). true / false force it.
    regional: Literal["auto", "true", "false"] = "auto"
    kl_chunk: int = 4096     # rows of (rows, vocab) logits alive at once in the loss (0 = all)

    def __post_init__(self):
        if isinstance(self.regional, bool):  # HealConfig(regional=True) from Python
            self.regional = "true" if self.regional else "false"
        if self.regional not in ("auto", "true", "false"):
            raise LlmaccelError(f"heal.regional must be auto, true or false, got {self.regional!r}")
        for k in ("steps", "eval_windows"):
            if getattr(self, k) < 1:
                raise LlmaccelError(f"heal.{k} must be positive, got {getattr(self, k)}")
        if not self.lr > 0:
            raise LlmaccelError(f"heal.lr must be positive, got {self.lr}")
        for k in ("sampled", "refresh"):
            if getattr(self, k) < -1:
                raise LlmaccelError(f"heal.{k} must be -1 (auto) or more, got {getattr(self, k)}")
        for k in ("hidden", "warmup", "minutes", "seq_len", "batch", "kl_chunk", "seed", "sample_batch"):
            if getattr(self, k) < 0:
                raise LlmaccelError(f"heal.{k} must not be negative, got {getattr(self, k)}")
        if not 0.0 <= self.calib_share <= 1.0:
            raise LlmaccelError(f"heal.calib_share must be in [0, 1], got {self.calib_share}")
        if not self.temperature > 0:
            raise LlmaccelError(f"heal.temperature must be positive, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise LlmaccelError(f"heal.top_p must be in (0, 1], got {self.top_p}")
        for k in ("domain_tokens", "domain_evals"):
            if getattr(self, k) < -1:
                raise LlmaccelError(f"heal.{k} must be -1 (auto) or more, got {getattr(self, k)}")

    def resolve_regional(self, gm: torch.fx.GraphModule) -> bool:
        """heal.regional with auto resolved for the graph to heal (on where it has linear attention)."""
        if self.regional != "auto":
            return self.regional == "true"
        return bool(op_nodes(gm, linear_attention))

    def domain_plan(self, device: str) -> tuple[int, int]:
        """(tokens per domain, measuring points during the heal), auto resolved for `device`."""
        cuda = str(device).startswith("cuda")
        tokens = self.domain_tokens if self.domain_tokens >= 0 else (2048 if cuda else 512)
        return tokens, self.domain_evals if self.domain_evals >= 0 else (4 if cuda else 1)

    def sampled_windows(self, ctx: PassContext, refresh: int) -> int:
        """heal.sampled with auto resolved: 2048 on CUDA with the engine's sampler, but none
        when `refresh` windows are sampled apart (they arrive from the start); else 0."""
        if self.sampled >= 0:
            return self.sampled
        return 0 if refresh and self.apart(ctx) else _auto(ctx, 2048)

    def engine_batch(self, ctx: PassContext) -> int:
        """heal.sample_batch with auto resolved for the source model's device."""
        return self.sample_batch or (256 if str(ctx.source_model.device).startswith("cuda") else 16)

    def apart(self, ctx: PassContext) -> bool:
        """heal.refresh_in resolved: whether the engine samples in a process of its own."""
        if self.refresh_in == "auto":
            return str(ctx.device).startswith("cuda")
        return self.refresh_in == "process"

    def refresh_windows(self, ctx: PassContext, wanted: int, have: int) -> int:
        """heal.refresh with auto resolved: _REFRESH_AUTO on CUDA with the engine's sampler when
        the heal would go round its `have` windows (a minutes budget, or `wanted` windows of steps x
        batch beyond them), else 0."""
        if self.refresh >= 0:
            return self.refresh
        return _auto(ctx, _REFRESH_AUTO) if self.minutes or wanted > have else 0


def _auto(ctx: PassContext, n: int) -> int:
    """n where the engine samples fast (CUDA, sampler and source model at hand), else 0."""
    able = ctx.sampler is not None and ctx.source_model is not None
    return n if able and str(ctx.device).startswith("cuda") else 0
