"""heal: short self-distillation of the transformed graph against the source model.

The student is the graph as the earlier passes left it; the teacher is `ctx.source_model`. The
loss is KL(teacher || student) on next-token distributions over calibration windows, plus an
optional MSE on the residual stream that feeds the final norm. The reference ops are
differentiable, so training is plain autograd through the IR graph: float weights get
requires_grad for the duration of the pass and are frozen again afterwards.

How a step runs (heal_train.py): on CUDA by default in bf16 autocast with fp32 master weights
(`heal.dtype`), the teacher's and student's forwards compiled by Inductor (`heal.compile`),
~16k tokens per step (`heal.batch`, `heal.seq_len`: 0 = sized for the device), the KL over the
vocabulary `heal.kl_chunk` rows at a time. On a CPU: fp32, eager, 2 x 64 tokens.

Quality is measured on calibration windows held out from training (the last `eval_windows`
windows of the calibration text), before and after, so the report says what healing bought;
and on every evaluation domain (heal_data.DomainEval: wikitext2's second half and texts of
other domains, never trained on) before, at `domain_evals` points during, and after the heal.
The stats also give the training throughput (`train_tok_s`, tokens per second of the training
loop, compilation included, domain measurements not; `steady_tok_s` without the first step,
which compiles) and the sampling of training windows by the engine (`sample_s`,
`sample_tok_s`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.passes import registry
from llmaccel.passes.base import Pass, PassContext, PassResult
from llmaccel.passes.heal_data import PROMPT_TOKENS, DomainEval, WindowPool, resolve_prompts, sample_source
from llmaccel.passes.heal_train import (Trainer, auto_shape, master_weights, resolve_backend,
                                        resolve_dtype)
from llmaccel.ir import is_op, positions, weight_of

_MAX_CURVE_POINTS = 100  # the report keeps at most this many loss values (bucket means)
_MAX_WINDOWS = 4096
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
    hidden: float = 0.0      # weight of the hidden-state loss (0 = logits KL only)
    embed: bool = False      # also train the token embedding / LM head (large, usually not needed)
    # Which of those weights train: all, or changed: only the ones the earlier passes changed
    # or added (a weight equal to the source's of the same name stays frozen: after gqa, the
    # attention's projections train and the MLPs and norms keep the source's values). On a CPU
    # heal of 38k tokens it beat `all` after gqa on every domain and lost after relu, whose
    # gates must move too (docs/quality.md).
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
    # The evaluation domains other than wikitext2 are not among the calibration text's, and
    # with 0.5 a gqa heal to one KV head ended +15% on wikitext2, +34% on code (2026-12-05).
    calib_share: float = 0.5
    # How the engine samples those windows: its temperature and top-p (nucleus) filter. Unfiltered
    # by default: a gqa heal to one KV head with top_p=0.9 (H200, 2026-12-05) ended better on
    # wikitext2 (+12.5% against +15%) but worse on docs (+36.9% against +27.5%).
    temperature: float = 1.0
    top_p: float = 1.0
    # Windows the engine samples while training runs (sharing the device), trained on as they
    # arrive, fresh ones first: a heal that goes over its windows many times fits them rather
    # than the source (heal_data.WindowPool). 0 = none; -1 = auto: _REFRESH_AUTO on CUDA with
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
    # Compile each decoder layer once and reuse it for the alike layers (heal_regions.py: nested
    # compile regions) instead of the whole graph. 2-core CPU, SmolLM2-135M shapes, Inductor:
    # first step 80 -> 39 s but later steps ~10% slower; sla 190 -> 62 s, later steps no slower.
    # Off by default: on an H200 (gqa) the first step was no faster (65 s) and later steps ~27%
    # slower (91,200 tok/s against 124,200+; docs/quality.md).
    regional: bool = False
    kl_chunk: int = 4096     # rows of (rows, vocab) logits alive at once in the loss (0 = all)

    def __post_init__(self):
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


def trainable_weights(gm: torch.fx.GraphModule, embed: bool,
                      source: torch.fx.GraphModule | None = None) -> dict[str, torch.nn.Parameter]:
    """Float parameters that distillation may change, by get_attr target.

    Skipped: integer/packed tensors and every float tensor read by an op that also reads an
    integer one (quantization scales and zeros belong to their packed weight); the embedding and
    LM head unless `embed`; with a `source` graph, every weight equal to its weight of the same
    target (heal.train=changed). A tied weight is one Parameter read by several nodes, so it
    appears once here and stays tied.
    """
    skip: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        attrs = [a for a in node.all_input_nodes if a.op == "get_attr"]
        tensors = [weight_of(gm, a) for a in attrs]
        quantized = any(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in tensors)
        if quantized or (not embed and is_op(node, ops.embedding, ops.lm_head)):
            skip.update(a.target for a in attrs)
    out: dict[str, torch.nn.Parameter] = {}
    seen: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in skip or node.target in out:
            continue
        t = weight_of(gm, node)
        if isinstance(t, torch.nn.Parameter) and t.is_floating_point() and id(t) not in seen:
            seen.add(id(t))
            out[node.target] = t
    if source is not None:
        out = {k: t for k, t in out.items() if not _unchanged(t, source, k)}
    return out


def _unchanged(t: torch.Tensor, source: torch.fx.GraphModule, target: str) -> bool:
    """Whether `source` holds a tensor at `target` with t's shape and values."""
    try:
        s = source.get_parameter(target)
    except AttributeError:
        try:
            s = source.get_buffer(target)
        except AttributeError:
            return False
    return s.shape == t.shape and torch.equal(s.to(t.device, t.dtype), t.detach())


def kl_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student), from logits."""
    s = student.float().flatten(0, -2).log_softmax(-1)
    t = teacher.float().flatten(0, -2).log_softmax(-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


@torch.no_grad()
def held_out_quality(gm, teacher_gm, windows: torch.Tensor, batch: int) -> dict:
    """Student perplexity, teacher perplexity and mean KL on next-token prediction in `windows`."""
    nll_s = nll_t = kl = 0.0
    n = 0
    for i in range(0, len(windows), batch):
        ids = windows[i: i + batch]
        x, y = ids[:, :-1], ids[:, 1:]
        ls, lt = gm(x, positions(x), None).float(), teacher_gm(x, positions(x), None).float()
        nll_s += F.cross_entropy(ls.flatten(0, 1), y.flatten(), reduction="sum").item()
        nll_t += F.cross_entropy(lt.flatten(0, 1), y.flatten(), reduction="sum").item()
        kl += kl_loss(ls, lt).item() * y.numel()
        n += y.numel()
    ppl, base = math.exp(nll_s / n), math.exp(nll_t / n)
    return {"ppl": ppl, "source_ppl": base, "delta_ppl_pct": 100 * (ppl / base - 1), "kl": kl / n}


def _lr_at(step: int, frac: float, c: HealConfig) -> float:
    """Linear warm-up over the first `warmup` steps, then cosine from lr to lr/10 as frac -> 1."""
    if step < c.warmup:
        return c.lr * (step + 1) / (c.warmup + 1)
    start = c.warmup / c.steps
    frac = min(1.0, max(0.0, (frac - start) / max(1e-9, 1 - start)))
    return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _curve(losses: list[float]) -> tuple[list[float], int]:
    every = max(1, math.ceil(len(losses) / _MAX_CURVE_POINTS))
    pts = [sum(losses[i: i + every]) / len(losses[i: i + every]) for i in range(0, len(losses), every)]
    return [float(f"{v:.5g}") for v in pts], every


_SYNC_EVERY = 8  # steps between reads of the loss (a read waits for the device)


class Heal(Pass):
    name = "heal"
    summary = "self-distillation (KL on logits, optional hidden-state MSE) against the source model"
    exact = False
    config_cls = HealConfig

    def __init__(self, config=None):
        super().__init__(config)
        self._early: WindowPool | None = None   # the pool whose sampling start() began

    def start(self, ctx: PassContext) -> None:
        """Where the engine samples in a process of its own and nothing is sampled before
        training, that process starts now, before the compile's first pass, so that its start-up
        (loading the model again, capturing its step graphs: ~40 s on an H100, while training
        cycled through the few file windows) overlaps the earlier passes instead."""
        c = self.config
        if ctx.source_model is None or not c.apart(ctx):
            return
        seq_len, batch = auto_shape(ctx.config, ctx.device, c.seq_len, c.batch)
        train, _, refresh, n = self._windows(ctx, seq_len, batch)
        if refresh and not n and ctx.sampler is not None:
            self._early = WindowPool(train.to(ctx.device), refresh)
            self._sample_beside(ctx, self._early, train, seq_len)

    def close(self) -> None:
        if self._early is not None:
            self._early.close()
            self._early = None

    def _windows(self, ctx: PassContext, seq_len: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(training windows, held-out windows, windows to sample while training, windows to
        sample before it), seq_len + 1 tokens each: the inputs and their next-token targets."""
        c = self.config
        # Training cycles through the windows, so more than _MAX_WINDOWS distinct ones (more than
        # a file's worth, or minutes of sampling for calib=self) are never asked for.
        n_train = min(c.steps * batch, _MAX_WINDOWS)
        windows = ctx.calib_tokens(n_train + c.eval_windows, seq_len + 1)
        if len(windows) < c.eval_windows + 1:
            raise LlmaccelError(f"heal: calibration text gives {len(windows)} windows of "
                                f"{seq_len + 1} tokens; need more than heal.eval_windows={c.eval_windows}")
        train, held = windows[: -c.eval_windows], windows[-c.eval_windows:]
        # whether the heal goes round its windows is judged on the file's: the windows sampled
        # before training depend on where `refresh` samples, so they come after
        refresh = c.refresh_windows(ctx, c.steps * batch, len(train))
        return train, held, refresh, c.sampled_windows(ctx, refresh)

    def _data(self, ctx: PassContext, seq_len: int,
              batch: int) -> tuple[torch.Tensor, torch.Tensor, int, dict]:
        """_windows' with the windows sampled before training among the training windows:
        (training windows, held-out windows, windows to sample while training, sampling stats)."""
        c = self.config
        train, held, refresh, n = self._windows(ctx, seq_len, batch)
        stats: dict = {"sample_s": 0.0, "sampled_windows": n}
        if n:
            kind = resolve_prompts(c.prompts, ctx.source_model)
            ctx.progress.log(f"heal: sampling {n} windows of {seq_len + 1} tokens ({kind} prompts)")
            sampled, more = sample_source(ctx, train, n, seq_len + 1, kind, seed=c.seed,
                                          prompt_len=min(PROMPT_TOKENS, max(1, seq_len // 2)),
                                          max_seqs=c.engine_batch(ctx), who="heal.sampled",
                                          calib_share=c.calib_share, temperature=c.temperature,
                                          top_p=c.top_p)
            stats.update(prompts=kind, **more)
            train = torch.cat([train.cpu(), sampled])
            # interleave file and sampled windows; seeded, so a compile is reproducible
            train = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(c.seed))]
        return train.to(ctx.device), held.to(ctx.device), refresh, stats

    def _sample_beside(self, ctx: PassContext, pool: WindowPool, train: torch.Tensor, seq_len: int) -> None:
        """Start the engine sampling pool.refresh windows while training runs."""
        c = self.config
        ctx.progress.log(f"heal: sampling up to {pool.refresh} more windows while training")
        pool.start(ctx, train, resolve_prompts(c.prompts, ctx.source_model),
                   prompt_len=min(PROMPT_TOKENS, max(1, seq_len // 2)),
                   seed=c.seed + 1, max_seqs=c.engine_batch(ctx), apart=c.apart(ctx),
                   calib_share=c.calib_share, temperature=c.temperature, top_p=c.top_p)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        if ctx.source_model is None:
            raise LlmaccelError("heal needs the source model to distil against (run it through compile)")
        teacher = ctx.source_model.gm
        params = trainable_weights(gm, c.embed, teacher if c.train == "changed" else None)
        if not params:
            what = " the earlier passes changed" if c.train == "changed" else ""
            raise LlmaccelError(f"heal: the graph has no float weights{what} it may train")
        seq_len, batch = auto_shape(ctx.config, ctx.device, c.seq_len, c.batch)
        train, held, refresh, sampling = self._data(ctx, seq_len, batch)
        # an early pool stays in _early until close(), which also ends it where run() fails first
        pool = self._early or WindowPool(train, refresh)
        # Passes with a training form: "before" is measured in their unhealed inference state.
        hooks = list(registry().values())
        for h in hooks:
            h.heal_schedule(gm, 1.0)
        before = held_out_quality(gm, teacher, held, batch)
        domains = DomainEval(ctx.source_model, *c.domain_plan(ctx.device), ctx.device)
        domains.measure(gm, 0, 0)
        dtype, backend = resolve_dtype(c.dtype, ctx.device), resolve_backend(c.compile, ctx.device)
        for p in params.values():
            p.requires_grad_(True)
        # TF32 matmuls for training only (about 2x on GPUs); before/after quality stays full fp32.
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            if refresh:
                sampling.setdefault("prompts", resolve_prompts(c.prompts, ctx.source_model))
                if not pool.started:
                    self._sample_beside(ctx, pool, train, seq_len)
            with master_weights(params):
                trainer = Trainer(gm, teacher, list(params.values()), lr=c.lr, hidden=c.hidden,
                                  dtype=dtype, backend=backend, kl_chunk=c.kl_chunk, log=ctx.progress.log,
                                  regional=c.regional)
                losses, timing = self._train(trainer, pool, batch, hooks, gm, ctx, domains)
        except torch.cuda.OutOfMemoryError as e:
            beside = (f" or heal.refresh=0 (the engine sampling beside training holds a KV cache "
                      f"of {c.engine_batch(ctx)} windows: heal.sample_batch)") if refresh else ""
            raise LlmaccelError(f"heal: out of device memory training {batch} x {seq_len} tokens "
                                f"per step; set heal.batch lower{beside}") from e
        finally:
            refreshed = pool.close()
            torch.set_float32_matmul_precision(precision)
            for p in params.values():
                p.requires_grad_(False)
                p.grad = None
        finished: dict = {}
        for h in hooks:
            h.heal_schedule(gm, 1.0)
            finished.update(h.heal_finish(gm))
        gm.graph.lint()
        gm.recompile()
        after = held_out_quality(gm, teacher, held, batch)
        curve, every = _curve(losses)
        tokens = len(losses) * batch * seq_len
        domains.measure(gm, len(losses), tokens)
        stats = {
            "steps": len(losses), "batch": batch, "seq_len": seq_len, "train_tokens": tokens,
            "distinct_windows": min(pool.n, len(losses) * batch),
            **refreshed,
            "params_trained": sum(p.numel() for p in params.values()),
            "dtype": str(dtype or "float32").removeprefix("torch."),
            "compiled": (trainer.backend or "off") + (" by layer" if trainer.regional else ""),
            **({"compile_error": trainer.compile_error} if trainer.compile_error else {}),
            **sampling, **timing,
            "train_tok_s": round(tokens / timing["train_s"], 1),
            "seconds_per_step": round(timing["train_s"] / max(1, len(losses)), 3),
            "held_out_tokens": held.shape[0] * (held.shape[1] - 1),
            "source_ppl": round(before["source_ppl"], 4),
            "ppl_before": round(before["ppl"], 4), "ppl_after": round(after["ppl"], 4),
            "delta_ppl_pct_before": round(before["delta_ppl_pct"], 3),
            "delta_ppl_pct_after": round(after["delta_ppl_pct"], 3),
            "kl_before": round(before["kl"], 5), "kl_after": round(after["kl"], 5),
            "loss_curve_every": every, "loss_curve": curve,
            **domains.stats(),
            **finished,
        }
        return PassResult(gm, len(params), stats)

    def _train(self, trainer: Trainer, pool: WindowPool, batch: int, hooks, gm,
               ctx: PassContext, domains: DomainEval) -> tuple[list[float], dict]:
        """The training loop: (loss per step, timing stats). Losses are read every _SYNC_EVERY
        steps so that the host queues steps ahead of the device. When training progress reaches
        one of `domains`' points, the student is measured there in its inference state (the
        training forms at 1.0); that time is left out of the clock (budget and throughput)."""
        c = self.config
        seq_len = pool.width - 1
        budget = 60 * c.minutes
        losses: list[float] = []
        pending: list[torch.Tensor] = []
        t0 = time.perf_counter()
        t1 = first_s = None  # end of the first step (compilation included)
        bar = ctx.progress(range(c.steps), desc="heal")
        for step in bar:
            frac = step / c.steps
            if budget and t1 is not None:
                left = budget - first_s
                frac = max(frac, (time.perf_counter() - t1) / left) if left > 0 else 1.0
                if frac >= 1.0:
                    break
            if domains.due(frac) and step:
                if pending:  # wait for the queued steps so that their time stays training time
                    losses += torch.stack(pending).tolist()
                    pending = []
                for h in hooks:
                    h.heal_schedule(gm, 1.0)
                paused = domains.measure(gm, step, step * batch * seq_len)
                t0 += paused
                t1 = None if t1 is None else t1 + paused
            for h in hooks:
                h.heal_schedule(gm, frac)
            pending.append(trainer.step(pool.buf[pool.batch(batch), :-1], _lr_at(step, frac, c)))
            if step in (0, c.steps - 1) or len(pending) >= _SYNC_EVERY:
                losses += torch.stack(pending).tolist()
                pending = []
                now = time.perf_counter()
                if t1 is None:
                    t1, first_s = now, now - t0
                    pool.go()  # compiled: the sampler may share the interpreter now
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{losses[-1]:.4f}",
                                    tok_s=f"{len(losses) * batch * seq_len / (now - t0):,.0f}")
        if pending:
            losses += torch.stack(pending).tolist()
        end = time.perf_counter()
        steady = len(losses) - 1
        return losses, {"train_s": round(end - t0, 3), "first_step_s": round(first_s or 0.0, 3),
                        "steady_tok_s": round(steady * batch * seq_len / (end - t1), 1)
                        if steady and end > t1 else None}


PASS = Heal
