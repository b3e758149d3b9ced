"""Heal throughput: training tokens per second of the heal pass, its defaults against the old settings.

Builds the model (default preset:smollm2-135m: SmolLM2-135M's shapes with random weights; speed
does not depend on weight values; a real source such as smollm2-135m works too), runs the
passes before heal (default gqa with kv_heads=1), then heals two copies of that graph:

- "new": the heal's defaults on the device (CUDA: bf16 autocast with fp32 master weights,
  Inductor, 512-token windows and ~16k tokens per step, KL in row chunks), `--steps` steps;
- "old": the settings the heal had (fp32 with TF32 matmuls, eager, 4 x 512, whole-batch KL),
  `--old-steps` steps;

and prints one JSON line: per run train_tok_s (training loop, compilation included),
steady_tok_s (after the first step), steps, batch, seq_len, dtype, compiled, first_step_s,
peak memory, first and last loss; and the ratios. Training windows are random token ids
unless --calib names a text file (the tokenizer of --src reads it).

    PYTHONPATH=$PWD python scripts/gpu_heal_throughput.py --out $OUT/heal_throughput.json
    PYTHONPATH=$PWD python scripts/gpu_heal_throughput.py --small      # tiny preset, CPU, seconds
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from llmaccel.compiler.model import load
from llmaccel.errors import LlmaccelError
from llmaccel.eval.text import load_tokens
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config, parse_sets

OLD = {"dtype": "float32", "compile": "off", "batch": "4", "seq_len": "512", "kl_chunk": "0"}


def _calib(model, args):
    g = torch.Generator().manual_seed(0)
    if args.calib:
        def from_text(n: int, s: int) -> torch.Tensor:
            ids = load_tokens(model, args.calib, "first-half", n * s, ctx=s)
            return ids[: len(ids) // s * s].view(-1, s)
        return from_text
    return lambda n, s: torch.randint(0, model.config.vocab_size, (n, s), generator=g)


def _prepare(args, device: str):
    """The graph after the passes before heal, and a context whose source is the model as loaded."""
    model = load(args.src, dtype=args.dtype, device=device)
    ctx = PassContext(model.config, device, Progress(args.progress), source_model=load(args.src, dtype=args.dtype, device=device))
    ctx.calib_source = _calib(ctx.source_model, args)
    names = [n for n in args.passes.split(",") if n]
    sets = parse_sets(args.set)
    for i, name in enumerate(names):
        cls = get_pass(name)
        ctx.later = (*names[i + 1:], "heal")  # passes with a training form emit it
        model.gm = cls(make_config(cls, sets.get(name, {}))).run(model.gm, ctx).gm
        model.gm.graph.lint()
        model.gm.recompile()
    return model, ctx, sets.get("heal", {})


def _heal(gm, ctx, opts: dict, device: str) -> dict:
    cls = get_pass("heal")
    cfg = make_config(cls, opts)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    st = cls(cfg).run(copy.deepcopy(gm), ctx).stats
    keep = ("train_tok_s", "steady_tok_s", "steps", "batch", "seq_len", "dtype", "compiled",
            "compile_error", "first_step_s", "train_s", "sample_s", "kl_before", "kl_after")
    out = {k: st[k] for k in keep if k in st}
    out.update(loss_first=st["loss_curve"][0], loss_last=st["loss_curve"][-1],
               pass_s=round(time.perf_counter() - t0, 2))
    if device.startswith("cuda"):
        out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", default="preset:smollm2-135m")
    p.add_argument("--passes", default="gqa", help="passes before heal, comma-separated")
    p.add_argument("--set", action="append", default=[],
                   help="PASS.KEY=VALUE, after gqa.kv_heads=1 (heal.* applies to the new run)")
    p.add_argument("--steps", type=int, default=40, help="steps of the new run")
    p.add_argument("--old-steps", type=int, default=10, help="steps of the old settings (0: skip)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", help="dtype the model is loaded in")
    p.add_argument("--calib", default=None, help="text file for the training windows (default random ids)")
    p.add_argument("--small", action="store_true", help="tiny preset and few steps (a CPU check)")
    p.add_argument("--progress", action="store_true", help="progress bars on stderr")
    p.add_argument("--out", default=None, help="also write the JSON line to this file")
    args = p.parse_args(argv)
    args.set = ["gqa.kv_heads=1", *args.set] if "gqa" in args.passes.split(",") else args.set
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.small:
        args.src, args.steps, args.old_steps = "preset:tiny-llama", min(args.steps, 6), min(args.old_steps, 3)
        if "gqa" in args.passes.split(","):
            args.set = ["gqa.calib_samples=2", "gqa.calib_seq_len=32", *args.set]
    try:
        model, ctx, heal_opts = _prepare(args, device)
        common = {"steps": str(args.steps), "eval_windows": "2"}
        result = {"src": args.src, "passes": args.passes, "set": args.set, "device": device,
                  "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
                  "torch": torch.__version__,
                  "new": _heal(model.gm, ctx, {**common, **heal_opts}, device)}
        if args.old_steps:
            old = {**common, **OLD, "steps": str(args.old_steps)}
            if args.small:
                old["seq_len"] = str(result["new"]["seq_len"])
            result["old"] = _heal(model.gm, ctx, old, device)
            for k in ("train_tok_s", "steady_tok_s"):
                a, b = result["new"].get(k), result["old"].get(k)
                result[f"ratio_{k}"] = round(a / b, 2) if a and b else None
    except LlmaccelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
