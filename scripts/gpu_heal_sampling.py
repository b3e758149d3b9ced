"""Measure the heal's training-window sampling through the engine on a GPU: tokens per second,
and that no GPU memory stays allocated once the engine is gone (what training then has).

    PYTHONPATH=$PWD python scripts/gpu_heal_sampling.py --model smollm2-135m --windows 1024 \
        --out out/heal_sampling.json

Prints (and writes with --out) one JSON line per run (--runs, default 2: the first pays the
kernels' compilation and the graphs' capture, the second shows what a warm process gets):
sample_s, sampled_tokens, sample_tok_s, the allocated memory before sampling, after it, and the
peak, in GiB.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from llmaccel.compiler.model import load
from llmaccel.heal.config import HealConfig
from llmaccel.heal.data import resolve_prompts
from llmaccel.passes.sampled import PROMPT_TOKENS, prompt_ids
from llmaccel.runtime.windows import sample_windows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=1024)
    ap.add_argument("--length", type=int, default=513, help="tokens per window, prompt included")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", default="auto", choices=["auto", "calib", "mixed"])
    ap.add_argument("--calib-share", type=float, default=HealConfig.calib_share)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    model = load(a.model, dtype=a.dtype, device=a.device)
    calib = torch.randint(0, model.config.vocab_size, (64, PROMPT_TOKENS),
                          generator=torch.Generator().manual_seed(0))
    kind = resolve_prompts(a.prompts, model)
    prompts = prompt_ids(model, calib, a.windows, kind, PROMPT_TOKENS, a.calib_share)
    cuda = a.device.startswith("cuda")
    lines = [json.dumps(run(model, prompts, a, kind, cuda, i)) for i in range(a.runs)]
    print("\n".join(lines))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("\n".join(lines) + "\n")


def run(model, prompts, a, kind: str, cuda: bool, i: int) -> dict:
    gib = 2 ** 30
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() / gib if cuda else None
    windows, st = sample_windows(model, prompts, a.length, seed=i, max_seqs=a.max_seqs)
    row = {"run": i, "model": a.model, "dtype": a.dtype, "windows": a.windows, "length": a.length,
           "max_seqs": a.max_seqs, "prompts": kind, **st, "shape": list(windows.shape)}
    if cuda:
        torch.cuda.synchronize()
        row.update(mem_before_gib=round(before, 3),
                   mem_after_gib=round(torch.cuda.memory_allocated() / gib, 3),
                   peak_gib=round(torch.cuda.max_memory_allocated() / gib, 3),
                   reserved_after_gib=round(torch.cuda.memory_reserved() / gib, 3))
    return row


if __name__ == "__main__":
    main()
