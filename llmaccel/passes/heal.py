"""heal: short self-distillation of the transformed graph against the source model.

The student is the graph as the earlier passes left it; the teacher is `ctx.source_model`. The
loss is KL(teacher || student) on next-token distributions over calibration windows, plus an
optional MSE on the residual stream that feeds the final norm. The reference ops are
differentiable, so training is plain autograd through the IR graph: float weights get
requires_grad for the duration of the pass and are frozen again afterwards.

Quality is measured on calibration windows held out from training (the last `eval_windows`
windows of the calibration text), before and after, so the report says what healing bought.
"""
from __future__ import annotations

import copy
import math
import operator
import time
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.eval.text import continue_samples
from llmaccel.passes import registry
from llmaccel.passes.base import Pass, PassContext, PassResult
from llmaccel.ir import is_op, weight_of

_MAX_CURVE_POINTS = 100  # the report keeps at most this many loss values (bucket means)
_MAX_WINDOWS = 4096
_PROMPT = 32         # calibration tokens that start each sampled window
# Sequences sampled at once. Memory: the fp32 KV cache (B x seq_len) and the prompt's logits
# (B x 32 x vocab): ~15 GB for SmolLM2 at 512 on CUDA, so several heals can share one GPU.
_SAMPLE_BATCH = {"cuda": 512, "cpu": 16}


@dataclass
class HealConfig:
    # Defaults sized for a 2-core CPU: a SmolLM2-135M step of 2 x 64 tokens costs ~28 CPU-seconds
    # (measured), so 40 steps take ~10 min on an idle machine. On a GPU use hundreds to
    # thousands of steps of 4 x 512 tokens (scripts/gpu_heal.sh).
    steps: int = 40
    lr: float = 5e-4
    seq_len: int = 64
    batch: int = 2
    hidden: float = 0.0      # weight of the hidden-state loss (0 = logits KL only)
    embed: bool = False      # also train the token embedding / LM head (large, usually not needed)
    eval_windows: int = 8    # held-out calibration windows for the before/after measurement
    warmup: int = 2          # linear warm-up steps, then cosine decay to lr/10
    # Wall-clock budget (0 = none): training progress is the larger of step/steps and
    # elapsed/budget, so the lr decay and the passes' schedules still complete when time runs out.
    minutes: float = 0.0
    # Training windows sampled from the source model (temperature 1), each continuing the first
    # _PROMPT tokens of a calibration window, added to the calibration windows. A file's worth of
    # windows is seen many times in a long heal and the student starts to fit those windows
    # rather than the source; samples are as many fresh windows as one asks for.
    sampled: int = 0

    def __post_init__(self):
        for k in ("steps", "seq_len", "batch", "eval_windows"):
            if getattr(self, k) < 1:
                raise LlmaccelError(f"heal.{k} must be positive, got {getattr(self, k)}")
        if not self.lr > 0:
            raise LlmaccelError(f"heal.lr must be positive, got {self.lr}")
        if self.hidden < 0 or self.warmup < 0 or self.minutes < 0 or self.sampled < 0:
            raise LlmaccelError("heal.hidden, heal.warmup, heal.minutes and heal.sampled must not "
                                "be negative")


def trainable_weights(gm: torch.fx.GraphModule, embed: bool) -> dict[str, torch.nn.Parameter]:
    """Float parameters that distillation may change, by get_attr target.

    Skipped: integer/packed tensors and every float tensor read by an op that also reads an
    integer one (quantization scales and zeros belong to their packed weight); the embedding and
    LM head unless `embed`. A tied weight is one Parameter read by several nodes, so it appears
    once here and stays tied.
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
    return out


def with_hidden(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A module sharing gm's weights that returns (logits, residual stream before the final norm)."""
    g = copy.deepcopy(gm.graph)
    heads = [n for n in g.nodes if is_op(n, ops.lm_head)]
    if len(heads) != 1:
        raise LlmaccelError("heal.hidden needs a graph with exactly one lm_head")
    x = heads[0].args[0]
    if is_op(x, operator.getitem) and is_op(x.args[0], ops.add_rms_norm, ops.add_layer_norm):
        fused = x.args[0]
        with g.inserting_after(fused):
            hidden = g.call_function(operator.add, (fused.args[0], fused.args[1]))
    elif is_op(x, ops.rms_norm, ops.layer_norm):
        hidden = x.args[0]
    else:
        hidden = x  # a norm some pass replaced: compare its output instead
    out = next(n for n in g.nodes if n.op == "output")
    out.args = ((out.args[0], hidden),)
    g.lint()
    return torch.fx.GraphModule(gm, g, class_name="heal_view")


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


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
        ls, lt = gm(x, _positions(x), None).float(), teacher_gm(x, _positions(x), None).float()
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


class Heal(Pass):
    name = "heal"
    summary = "self-distillation (KL on logits, optional hidden-state MSE) against the source model"
    exact = False
    config_cls = HealConfig

    def _data(self, ctx: PassContext) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        # seq_len + 1 tokens per window: the inputs and their next-token targets
        # Training cycles through the windows, so more than _MAX_WINDOWS distinct ones (more than
        # a file's worth, or minutes of sampling for calib=self) are never asked for.
        n_train = min(c.steps * c.batch, _MAX_WINDOWS)
        windows = ctx.calib_tokens(n_train + c.eval_windows, c.seq_len + 1)
        if len(windows) < c.eval_windows + 1:
            raise LlmaccelError(f"heal: calibration text gives {len(windows)} windows of "
                                f"{c.seq_len + 1} tokens; need more than heal.eval_windows={c.eval_windows}")
        train, held = windows[: -c.eval_windows], windows[-c.eval_windows:]
        if c.sampled:
            train = torch.cat([train, self._sample(ctx, train)])
            # interleave file and sampled windows; seeded, so a compile is reproducible
            train = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(0))]
        return train.to(ctx.device), held.to(ctx.device)

    def _sample(self, ctx: PassContext, train: torch.Tensor) -> torch.Tensor:
        c = self.config
        model = ctx.source_model
        prompts = train[torch.arange(c.sampled) % len(train), : min(_PROMPT, c.seq_len)]
        gen = torch.Generator(device=model.device).manual_seed(0)
        bs = _SAMPLE_BATCH.get(torch.device(model.device).type, 16)
        out = [continue_samples(model, prompts[i: i + bs], c.seq_len + 1, gen).cpu()
               for i in ctx.progress(range(0, c.sampled, bs), desc="heal: sampling")]
        return torch.cat(out)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        if ctx.source_model is None:
            raise LlmaccelError("heal needs the source model to distil against (run it through compile)")
        teacher = ctx.source_model.gm
        params = trainable_weights(gm, c.embed)
        if not params:
            raise LlmaccelError("heal: the graph has no float weights it may train")
        train, held = self._data(ctx)
        # Passes with a training form: "before" is measured in their unhealed inference state.
        hooks = list(registry().values())
        for h in hooks:
            h.heal_schedule(gm, 1.0)
        before = held_out_quality(gm, teacher, held, c.batch)
        student_fwd = with_hidden(gm) if c.hidden else gm
        teacher_fwd = with_hidden(teacher) if c.hidden else teacher
        for p in params.values():
            p.requires_grad_(True)
        opt = torch.optim.AdamW(list(params.values()), lr=c.lr, weight_decay=0.0)
        losses: list[float] = []
        t0 = time.perf_counter()
        budget = 60 * c.minutes
        # TF32 matmuls for training only (about 2x on GPUs); before/after quality stays full fp32.
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            bar = ctx.progress(range(c.steps), desc="heal")
            for step in bar:
                frac = step / c.steps
                if budget:
                    frac = max(frac, (time.perf_counter() - t0) / budget)
                    if frac >= 1.0:
                        break
                for h in hooks:
                    h.heal_schedule(gm, frac)
                idx = [(step * c.batch + j) % len(train) for j in range(c.batch)]
                x = train[idx, :-1]
                with torch.no_grad():
                    t_out = teacher_fwd(x, _positions(x), None)
                s_out = student_fwd(x, _positions(x), None)
                if c.hidden:
                    (s_log, s_h), (t_log, t_h) = s_out, t_out
                    loss = kl_loss(s_log, t_log)
                    loss = loss + c.hidden * F.mse_loss(s_h.float(), t_h.float()) / t_h.float().pow(2).mean()
                else:
                    loss = kl_loss(s_out, t_out)
                for group in opt.param_groups:
                    group["lr"] = _lr_at(step, frac, c)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
                opt.step()
                losses.append(loss.item())
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{losses[-1]:.4f}")
        finally:
            torch.set_float32_matmul_precision(precision)
            for p in params.values():
                p.requires_grad_(False)
                p.grad = None
        seconds = time.perf_counter() - t0
        finished: dict = {}
        for h in hooks:
            h.heal_schedule(gm, 1.0)
            finished.update(h.heal_finish(gm))
        gm.graph.lint()
        gm.recompile()
        after = held_out_quality(gm, teacher, held, c.batch)
        curve, every = _curve(losses)
        stats = {
            "steps": len(losses), "train_tokens": len(losses) * c.batch * c.seq_len,
            "distinct_windows": min(len(train), len(losses) * c.batch), "sampled_windows": c.sampled,
            "params_trained": sum(p.numel() for p in params.values()),
            "seconds_per_step": round(seconds / max(1, len(losses)), 3),
            "held_out_tokens": held.shape[0] * (held.shape[1] - 1),
            "source_ppl": round(before["source_ppl"], 4),
            "ppl_before": round(before["ppl"], 4), "ppl_after": round(after["ppl"], 4),
            "delta_ppl_pct_before": round(before["delta_ppl_pct"], 3),
            "delta_ppl_pct_after": round(after["delta_ppl_pct"], 3),
            "kl_before": round(before["kl"], 5), "kl_after": round(after["kl"], 5),
            "loss_curve_every": every, "loss_curve": curve,
            **finished,
        }
        return PassResult(gm, len(params), stats)


PASS = Heal
