"""heal: short self-distillation of the transformed graph against the source model.

The student is the graph as the earlier passes left it; the teacher is `ctx.source_model`. The
loss is KL(teacher || student) on next-token distributions over calibration windows, plus an
optional MSE on the residual stream that feeds the final norm. The reference ops are
differentiable, so training is plain autograd through the IR graph: float weights get
requires_grad for the duration of the pass and are frozen again afterwards.

How a step runs (train.py): on CUDA by default in bf16 autocast with fp32 master weights
(`heal.dtype`), the teacher's and student's forwards compiled by Inductor (`heal.compile`),
~16k tokens per step (`heal.batch`, `heal.seq_len`: 0 = sized for the device), the KL over the
vocabulary `heal.kl_chunk` rows at a time. On a CPU: fp32, eager, 2 x 64 tokens.

Quality is measured on calibration windows held out from training (the last `eval_windows`
windows of the calibration text), before and after, so the report says what healing bought;
and on every evaluation domain (data.DomainEval: wikitext2's second half and texts of
other domains, never trained on) before, at `domain_evals` points during, and after the heal.
The stats also give the training throughput (`train_tok_s`, tokens per second of the training
loop, compilation included, domain measurements not; `steady_tok_s` without the first step,
which compiles) and the sampling of training windows by the engine (`sample_s`,
`sample_tok_s`).
"""
from __future__ import annotations

import contextlib
import math
import operator
import signal
import threading
import time

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.eval.domains import ppl_of
from llmaccel.heal.config import HealConfig
from llmaccel.heal.data import DomainEval, WindowPool, resolve_prompts
from llmaccel.passes import rewrites
from llmaccel.passes.base import Pass, PassContext, PassResult
from llmaccel.passes.sampled import PROMPT_TOKENS, sample_source
from llmaccel.heal.train import (Trainer, auto_shape, master_weights, resolve_backend,
                                        resolve_dtype)
from llmaccel.ir import is_op, positions, weight_of

_MAX_CURVE_POINTS = 100  # the report keeps at most this many loss values (bucket means)
_MAX_WINDOWS = 4096


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
        s = operator.attrgetter(target)(source)
    except AttributeError:
        return False
    same_shape = isinstance(s, torch.Tensor) and s.shape == t.shape
    return same_shape and torch.equal(s.to(t.device, t.dtype), t.detach())


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
    ppl, base = ppl_of(nll_s / n), ppl_of(nll_t / n)
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


def _compile_seconds() -> float | None:
    """Seconds torch.compile has spent in this process so far (Dynamo's own tally: tracing,
    AOTAutograd, Inductor's code generation, the kernels' compilation; forwards and backwards),
    or None where this torch does not keep it."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        spent = calculate_time_spent()
    except Exception:  # noqa: BLE001 - a private tally: no figure rather than no heal
        return None
    return spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0)


@contextlib.contextmanager
def _stop_on_interrupt(log):
    """An Event set by a Ctrl-C (SIGINT) while it is open: the heal then ends after the step
    under way and the compile goes on with what it trained (minutes of a long heal are not
    thrown away); a second Ctrl-C raises KeyboardInterrupt as usual. Handlers can only be set
    in the main thread: elsewhere Ctrl-C keeps its usual effect."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        log("heal: interrupted; ending after this step and keeping what it trained "
            "(Ctrl-C again to abort)")

    before = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        # None: a handler set outside Python, which cannot be put back; the default then
        signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)


class Heal(Pass):
    name = "heal"
    trains = True
    summary = "self-distillation (KL on logits, optional hidden-state MSE) against the source model"
    exact = False
    config_cls = HealConfig

    def __init__(self, config=None):
        super().__init__(config)
        self._early: WindowPool | None = None   # the pool whose sampling start() began
        # start()'s (seq_len, batch): run() trains with the windows start() sampled for, though
        # the free device memory the auto batch is sized from has changed since
        self._shape: tuple[int, int] | None = None

    def start(self, ctx: PassContext) -> None:
        """Where the engine samples in a process of its own and nothing is sampled before
        training, that process starts now, before the compile's first pass, so that its start-up
        (loading the model again, capturing its step graphs: ~40 s on an H100, while training
        cycled through the few file windows) overlaps the earlier passes instead."""
        c = self.config
        if ctx.source_model is None or not c.apart(ctx):
            return
        seq_len, batch = self._shape = auto_shape(ctx.config, ctx.device, c.seq_len, c.batch)
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
        teacher, params = _teacher_and_params(gm, ctx, c)
        seq_len, batch = self._shape or auto_shape(ctx.config, ctx.device, c.seq_len, c.batch)
        train, held, refresh, sampling = self._data(ctx, seq_len, batch)
        # an early pool stays in _early until close(), which also ends it where run() fails first
        pool = self._early or WindowPool(train, refresh)
        # Passes with a training form: "before" is measured in their unhealed inference state.
        hooks = [f for f in (cls.training_form(gm) for cls in rewrites().values()) if f is not None]
        for h in hooks:
            h.schedule(1.0)
        before = held_out_quality(gm, teacher, held, batch)
        domains = DomainEval(ctx.source_model, *c.domain_plan(ctx.device), ctx.device)
        domains.measure(gm, 0, 0)
        dtype = resolve_dtype(c.dtype, ctx.device, params.values())
        backend = resolve_backend(c.compile, ctx.device)
        try:
            if refresh:
                sampling.setdefault("prompts", resolve_prompts(c.prompts, ctx.source_model))
                if not pool.started:
                    self._sample_beside(ctx, pool, train, seq_len)
            with _training(params), master_weights(params):
                trainer = Trainer(gm, teacher, list(params.values()), lr=c.lr, hidden=c.hidden,
                                  dtype=dtype, backend=backend, kl_chunk=c.kl_chunk, log=ctx.progress.log,
                                  regional=c.resolve_regional(gm))
                losses, timing = self._train(trainer, pool, batch, hooks, gm, ctx, domains)
        except torch.cuda.OutOfMemoryError as e:
            beside = (f" or heal.refresh=0 (the engine sampling beside training holds a KV cache "
                      f"of {c.engine_batch(ctx)} windows: heal.sample_batch)") if refresh else ""
            raise LlmaccelError(f"heal: out of device memory training {batch} x {seq_len} tokens "
                                f"per step; set heal.batch lower{beside}") from e
        finally:
            refreshed = pool.close()
            self._early = None   # its buffer of windows goes with it
        finished: dict = {}
        for h in hooks:
            h.schedule(1.0)
            finished.update(h.finish())
        gm.graph.lint()
        gm.recompile()
        after = held_out_quality(gm, teacher, held, batch)
        tokens = len(losses) * batch * seq_len
        domains.measure(gm, len(losses), tokens)
        stats = {
            "steps": len(losses), "batch": batch, "seq_len": seq_len, "train_tokens": tokens,
            "distinct_windows": min(pool.n, len(losses) * batch), **refreshed,
            "params_trained": sum(p.numel() for p in params.values()),
            "dtype": str(dtype or "float32").removeprefix("torch."), **_trainer_stats(trainer),
            **sampling, **timing, "train_tok_s": round(tokens / timing["train_s"], 1),
            "seconds_per_step": round(timing["train_s"] / max(1, len(losses)), 3),
            **_quality_stats(held, before, after, losses), **domains.stats(), **finished,
        }
        return PassResult(gm, len(params), stats)

    def _train(self, trainer: Trainer, pool: WindowPool, batch: int, hooks, gm,
               ctx: PassContext, domains: DomainEval) -> tuple[list[float], dict]:
        """The training loop: (loss per step, timing stats). Losses are read every _SYNC_EVERY
        steps so that the host queues steps ahead of the device. When training progress reaches
        one of `domains`' points, the student is measured there in its inference state (the
        training forms at 1.0); that time is left out of the clock (budget and throughput).
        A Ctrl-C ends it after the step under way (_stop_on_interrupt)."""
        c = self.config
        seq_len = pool.width - 1
        budget = 60 * c.minutes
        losses: list[float] = []
        pending: list[torch.Tensor] = []
        compiled_before = _compile_seconds()
        t0 = time.perf_counter()
        t1 = first_s = None  # end of the first step (compilation included)
        # with a minutes budget the bar counts percent of the training progress that ends the
        # heal (time or steps), not steps of heal.steps, which the budget stops long before
        bar = ctx.progress(None, desc="heal", total=100 if budget else c.steps,
                           unit="%" if budget else "step")
        with _stop_on_interrupt(ctx.progress.log) as interrupted:
            for step in range(c.steps):
                frac = step / c.steps
                if budget and t1 is not None:
                    left = budget - first_s
                    frac = max(frac, (time.perf_counter() - t1) / left) if left > 0 else 1.0
                if frac >= 1.0 or interrupted.is_set():
                    break
                if domains.due(frac) and step:
                    if pending:  # wait for the queued steps so that their time stays training time
                        losses += torch.stack(pending).tolist()
                        pending = []
                    for h in hooks:
                        h.schedule(1.0)
                    paused = domains.measure(gm, step, step * batch * seq_len)
                    t0 += paused
                    t1 = None if t1 is None else t1 + paused
                for h in hooks:
                    h.schedule(frac)
                pending.append(trainer.step(pool.buf[pool.batch(batch), :-1], _lr_at(step, frac, c)))
                if step in (0, c.steps - 1) or len(pending) >= _SYNC_EVERY:
                    losses += torch.stack(pending).tolist()
                    pending = []
                    now = time.perf_counter()
                    if t1 is None:
                        t1, first_s = now, now - t0
                        pool.go()  # compiled: the sampler may share the interpreter now
                    bar.update((int(100 * frac) if budget else step + 1) - bar.n)
                    bar.set_postfix(step=step + 1, loss=f"{losses[-1]:.4f}",
                                    tok_s=f"{len(losses) * batch * seq_len / (now - t0):,.0f}")
            if pending:
                losses += torch.stack(pending).tolist()
        if not interrupted.is_set():  # a budget's last step ends short of 100%
            bar.update((100 if budget else c.steps) - bar.n)
        bar.close()
        return losses, _timing(trainer, losses, batch * seq_len, (t0, t1, first_s), compiled_before,
                               interrupted.is_set())


@contextlib.contextmanager
def _training(params: dict):
    """The weights trainable and TF32 matmuls (about 2x on GPUs) while training only: quality
    before and after stays full fp32; the weights leave without gradients."""
    precision = torch.get_float32_matmul_precision()
    for p in params.values():
        p.requires_grad_(True)
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        for p in params.values():
            p.requires_grad_(False)
            p.grad = None


def _timing(trainer, losses, step_tokens: int, clock, compiled_before, interrupted: bool) -> dict:
    """The heal's timing stats: clock = (start, end of the first step, its seconds)."""
    t0, t1, first_s = clock
    end = time.perf_counter()
    steady = len(losses) - 1
    compiled = _compile_seconds()
    # torch.compile's seconds in training, nearly all in the first step: of first_step_s the
    # rest is running it and waiting for the first windows
    compile_s = ({"compile_s": round(compiled - compiled_before, 3)}
                 if trainer.backend and None not in (compiled, compiled_before) else {})
    return {"train_s": round(end - t0, 3), "first_step_s": round(first_s or 0.0, 3), **compile_s,
            "steady_tok_s": round(steady * step_tokens / (end - t1), 1) if steady and end > t1 else None,
            **({"interrupted_at_step": len(losses)} if interrupted else {})}


def _teacher_and_params(gm, ctx: PassContext, c):
    """The source graph to distil against and the weights the heal may train (a clear error
    where either is missing)."""
    if ctx.source_model is None:
        raise LlmaccelError("heal needs the source model to distil against (run it through compile)")
    teacher = ctx.source_model.gm
    params = trainable_weights(gm, c.embed, teacher if c.train == "changed" else None)
    if not params:
        what = " the earlier passes changed" if c.train == "changed" else ""
        raise LlmaccelError(f"heal: the graph has no float weights{what} it may train")
    return teacher, params


def _trainer_stats(trainer) -> dict:
    return {"compiled": (trainer.backend or "off") + (" by layer" if trainer.regional else ""),
            **({"compile_error": trainer.compile_error} if trainer.compile_error else {})}


def _quality_stats(held: torch.Tensor, before: dict, after: dict, losses: list[float]) -> dict:
    """The held-out windows' quality before and after, and the loss curve."""
    curve, every = _curve(losses)
    return {
        "held_out_tokens": held.shape[0] * (held.shape[1] - 1),
        "source_ppl": round(before["source_ppl"], 4),
        "ppl_before": round(before["ppl"], 4), "ppl_after": round(after["ppl"], 4),
        "delta_ppl_pct_before": round(before["delta_ppl_pct"], 3),
        "delta_ppl_pct_after": round(after["delta_ppl_pct"], 3),
        "kl_before": round(before["kl"], 5), "kl_after": round(after["kl"], 5),
        "loss_curve_every": every, "loss_curve": curve,
    }


PASS = Heal
