"""The compile pipeline: load a source, run passes in order, verify, measure, report."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from llmaccel.codegen.lower import lower
from llmaccel.compiler import executor
from llmaccel.compiler.artifact import read_manifest
from llmaccel.compiler.model import Model, load
from llmaccel.errors import LlmaccelError
from llmaccel.eval.text import SPLITS, load_tokens
from llmaccel.ir import op_counts
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config

_OTHER_HALF = {"first-half": "second-half", "second-half": "first-half"}


def parse_pass_list(passes) -> list[str]:
    if isinstance(passes, str):
        passes = [p for p in passes.split(",")]
    names = [p.strip() for p in passes if p.strip()]
    for i, n in enumerate(names):
        cls = get_pass(n)
        if n in names[:i]:
            raise LlmaccelError(f"pass {n!r} is listed twice; a pass runs once")
        early = [m for m in names[:i] if m in cls.before]
        if early:  # refused before any work: some passes rewrite what this one reads
            order = ",".join([n] + [m for m in names if m != n])
            raise LlmaccelError(f"{n} must run before {', '.join(early)} (it reads the layers "
                                f"they rewrite); reorder the passes, e.g. --passes {order}")
    return names


def _calib_source(calib: str, split: str, source: Model, progress: bool):
    def make(n: int, seq_len: int) -> torch.Tensor:
        ids = load_tokens(source, calib, split, n * seq_len, ctx=seq_len, seed=0, progress=progress,
                          purpose="for calibration (--calib FILE reads a text file instead)")
        n_full = len(ids) // seq_len
        if n_full == 0:
            raise LlmaccelError(f"calibration text gives {len(ids)} tokens, fewer than one "
                                f"sample of {seq_len}")
        return ids[: n_full * seq_len].view(n_full, seq_len)
    return make


def _verify(before: torch.Tensor, after: torch.Tensor) -> dict:
    diff = (after.float() - before.float()).abs()
    return {"max_abs": diff.max().item(),
            "max_rel": (diff / before.float().abs().clamp_min(1e-6)).max().item(),
            "max_abs_over_max": diff.max().item() / before.float().abs().max().item()}


def compile(source: str, passes=(), options: dict | None = None, *, calib: str = "mixed",
            calib_split: str = "first-half", verify: bool = False, eval_tokens: int | None = None,
            dtype="float32", device: str = "cpu", progress: bool = True, sampler=None,
            baseline: str | None = None, eval_ctx: int | None = None) -> Model:
    """Compile `source` with `passes` (names, in order). Returns the model; `model.report` says how.
    sampler: what passes that generate text continue prompts with (PassContext.sampler;
    llmaccel.compile and `llmc compile` give the engine's). baseline: the model the approximate
    passes fit to and distil from and the quality check compares with, read with its tokenizer
    (default: `source` as loaded); e.g. the original model when `source` is an artifact to heal
    further, which would otherwise be its own teacher. eval_ctx: the quality check's window
    (a long one for passes that act on long contexts: kvquant; default 512, or the model's
    context if shorter; default eval_tokens is then at least one window)."""
    names, configs = _checked(passes, options or {}, calib, calib_split, eval_tokens)
    model = load(source, dtype=dtype, device=device)
    if eval_ctx is None:
        eval_ctx = min(512, model.config.max_position)
    elif not 2 <= eval_ctx <= model.config.max_position:
        raise LlmaccelError(f"eval_ctx must be 2 .. {model.config.max_position} (the model's context), "
                            f"got {eval_ctx}")
    if not baseline and model.recipe:
        _check_own_teacher(source, names)
    reporter = Progress(progress)
    # Passes and the quality check compare against the model as it was loaded, or the baseline.
    reference = (load(baseline or source, dtype=dtype, device=device)
                 if baseline or any(not get_pass(n).exact for n in names) else None)
    if baseline:
        _check_baseline(model.config, reference.config, source, baseline)
    ctx = PassContext(model.config, device, reporter,
                      calib_source=_calib_source(calib, calib_split, reference or model, progress),
                      source_model=reference, sampler=sampler)
    sample = torch.randint(0, model.config.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(0)).to(device)
    report = {"source": source, "dtype": str(model.dtype).removeprefix("torch."),
              "calib": calib, "calib_split": calib_split, "ops_before": model.op_counts(),
              **({"baseline": baseline} if baseline else {}), "passes": []}
    logits = _run_passes(model, names, configs, ctx, report, sample, verify)
    report["ops_after"] = model.op_counts()
    if verify:
        report["lowering"] = _verify_lowering(model, sample, logits)
    if eval_tokens is None:
        eval_tokens = max(4096, eval_ctx) if reference is not None else 0
    if eval_tokens:
        report["quality"] = _held_apart_quality(model, reference or load(source, dtype=dtype, device=device),
                                                calib, calib_split, eval_tokens, progress, eval_ctx)
    model.report = report
    return model


def _checked(passes, options: dict, calib: str, calib_split: str, eval_tokens) -> tuple[list, list]:
    """The pass names and their configs, every argument checked before any work."""
    if calib_split not in SPLITS:
        raise LlmaccelError(f"unknown calibration split {calib_split!r}; known: {', '.join(SPLITS)}")
    if calib not in ("self", "mixed") and not Path(calib).is_file():
        raise LlmaccelError(f"no such text file: {calib} (--calib takes a text file, 'mixed' or 'self')")
    if eval_tokens is not None and (not isinstance(eval_tokens, int) or eval_tokens < 0):
        raise LlmaccelError(f"eval_tokens must be a count >= 0, got {eval_tokens!r}")
    names = parse_pass_list(passes)
    for name in options:
        if name not in names:
            get_pass(name)
            raise LlmaccelError(f"options given for pass {name!r}, which is not in the pass list")
    return names, [make_config(get_pass(n), options.get(n, {})) for n in names]


def _run_passes(model: Model, names: list[str], configs: list, ctx: PassContext, report: dict,
                sample: torch.Tensor, verify: bool):
    """Each pass on model.gm in order, its entry in the recipe and the report; every pass's
    start() first and close() last, failed or not. Returns the last logits of `sample`
    (with verify)."""
    logits = model.logits(sample) if verify else None  # of the graph as it stands
    instances = [get_pass(n)(cfg) for n, cfg in zip(names, configs)]
    try:
        for p in instances:
            p.start(ctx)
        for i, (name, p) in enumerate(zip(names, instances)):
            ctx.trained = any(q.trains for q in instances[i + 1:])
            ctx.progress.log(f"pass {name} ...")
            t0 = time.perf_counter()
            res = p.run(model.gm, ctx)
            res.gm.graph.lint()
            res.gm.recompile()
            model.gm = res.gm
            entry = {"name": name, "options": dataclasses.asdict(p.config), "exact": p.exact,
                     "changed": res.changed, "stats": res.stats,
                     "seconds": round(time.perf_counter() - t0, 3)}
            if verify:
                before, logits = logits, model.logits(sample)
                entry["verify"] = _verify(before, logits)
            model.recipe.append(entry)
            report["passes"].append(entry)
    finally:
        for p in instances:
            p.close()
    return logits


def _check_own_teacher(source: str, names: list[str]) -> None:
    """A heal of an artifact with only exact passes before it would distil the model against
    itself (KL 0 from the first step): refused before minutes of it, naming the model the
    artifact was compiled from."""
    if "heal" not in names or not all(get_pass(n).exact for n in names[:names.index("heal")]):
        return
    try:
        origin = read_manifest(Path(source)).get("source")
    except LlmaccelError:
        origin = None
    raise LlmaccelError(f"heal: {source} is an artifact and would be its own teacher (KL 0: nothing to "
                        f"learn); give --baseline the model it was compiled from"
                        + (f" ({origin})" if isinstance(origin, str) else ""))


def _check_baseline(config, ref, source: str, baseline: str) -> None:
    """The passes compare the two layer by layer and logit by logit: same vocabulary, width and
    depth, of the same family (heads may differ: gqa changes them)."""
    for k in ("family", "vocab_size", "hidden_size", "n_layers"):
        if getattr(config, k) != getattr(ref, k):
            raise LlmaccelError(f"baseline {baseline} has {k}={getattr(ref, k)} where {source} has "
                                f"{getattr(config, k)}; the baseline must be a model of the same shape "
                                f"(for an artifact, the model it was compiled from)")


def _verify_lowering(model: Model, sample: torch.Tensor, logits: torch.Tensor) -> dict:
    """The final graph lowered as the runtime lowers it against the graph itself on the same
    sample: lowering is a rewrite too, checked like the passes. Every op with a kernel or a
    traced form on its custom op and RoPE on tables (the top-level figures), then with each
    linear form a step may use: `rows` (row products a compiled step fuses) and `gemv` (the
    fused GEMVs with the norm, SiLU-mul and residual moved inside; here their custom ops run
    the reference, so the check is of the graph rewrite; the kernels are tested against the
    same reference in tests/kernels)."""
    def run(linear: str):
        low, rep = lower(model.gm, max_len=model.config.max_position, select="all", linear=linear)
        cache = executor.make_cache(low, sample.shape[0], sample.shape[1], model.dtype, model.device)
        return _verify(logits, executor.forward(low, sample, 0, cache)), rep

    out, rep = run("mm")
    out.update(custom=rep.custom, cpu_traced=rep.cpu_traced, rope=rep.rope)
    ver, rep = run("rows")
    out["rows"] = dict(ver, linears=rep.linear_rows, norms=rep.norm_into_rows)
    ver, rep = run("gemv")
    out["gemv"] = dict(ver, **rep.gemv)
    return out


def _held_apart_quality(model, baseline, calib, calib_split, n_tokens, progress, ctx: int = 512) -> dict:
    """Perplexity and KL against the source on text the passes were not calibrated on."""
    from llmaccel.eval.perplexity import evaluate

    if calib == "self":
        ids = load_tokens(baseline, "self", "all", n_tokens, seed=1, progress=progress,  # calibration: seed 0
                          purpose="for the quality check (--eval-tokens N: how many, 0: none)")
        text = "self (seed 1)"
    elif calib == "mixed":  # calibrated on wikitext2's first half among others: its second half
        from llmaccel.eval.domains import DATA_DIR, DOMAINS

        rel, split = DOMAINS["wikitext2"]
        ids = load_tokens(baseline, str(DATA_DIR / rel), split, n_tokens)
        text = f"wikitext2 ({split})"
    elif calib_split in _OTHER_HALF:
        split = _OTHER_HALF[calib_split]
        ids = load_tokens(baseline, calib, split, n_tokens)
        text = f"{calib} ({split})"
    else:
        return {"skipped": "calibration used the whole file: no held-apart text"}
    res = evaluate(model, ids, ctx=ctx, baseline=baseline, progress=progress)
    res.update(text=text, delta_ppl_pct=100 * (res["ppl"] / res["baseline_ppl"] - 1))
    return res


__all__ = ["compile", "op_counts"]
