"""Measure an ONNX export against the llmaccel reference executor (CPU, fp32).

    python scripts/export_check.py SRC --format onnx|genai [--ppl-tokens 16384] [--out DIR]

Prints one JSON line: logits max abs diff on a prefill and on cached decode steps, greedy
agreement over 32 tokens through onnxruntime (and through onnxruntime-genai for a genai
folder), and with --ppl-tokens the wikitext2 second-half perplexity of both.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from llmaccel.compiler.model import load
from llmaccel.eval.perplexity import evaluate
from llmaccel.eval.text import file_tokens
from llmaccel.export.exporter import export
from llmaccel.export.runtime import OnnxModel, genai_greedy
from llmaccel.sampling import SamplingParams

WIKI = Path(__file__).resolve().parents[1] / "llmaccel" / "data" / "wikitext2" / "wiki.test.raw"
PROMPT = "Once upon a time, in a small village,"


def logits_diffs(ref, onx, ids: torch.Tensor, split: int) -> dict:
    pre = (ref.logits(ids) - onx.logits(ids)).abs().max().item()
    c1, c2 = ref.new_cache(1, ids.shape[1]), onx.new_cache(1, ids.shape[1])
    ref.logits(ids[:, :split], 0, c1)
    onx.logits(ids[:, :split], 0, c2)
    dec = 0.0
    for t in range(split, ids.shape[1]):
        a = ref.logits(ids[:, t:t + 1], t, c1)
        b = onx.logits(ids[:, t:t + 1], t, c2)
        dec = max(dec, (a - b).abs().max().item())
    return {"prefill_max_abs": pre, "decode_max_abs": dec}


def agreement(a: list[int], b: list[int]) -> dict:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return {"same": sum(x == y for x, y in zip(a, b)), "of": min(len(a), len(b)), "first_diff": first}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("--format", default="onnx", choices=["onnx", "genai"])
    ap.add_argument("--ppl-tokens", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ref = load(a.src)
    out = a.out or tempfile.mkdtemp(prefix="llmaccel-export-")
    t0 = time.perf_counter()
    export(ref, out, fmt=a.format)
    res = {"src": a.src, "format": a.format, "export_s": round(time.perf_counter() - t0, 1),
           "folder_bytes": sum(f.stat().st_size for f in Path(out).iterdir())}
    onx = OnnxModel(out)
    ids = torch.tensor([ref.encode("The quick brown fox jumps over the lazy dog. " * 6)])
    res.update(logits_diffs(ref, onx, ids, 40))
    prompt = ref.encode(PROMPT)
    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = list(ref.generate_ids(prompt, p))
    res["greedy_onnxruntime"] = agreement(want, list(onx.generate_ids(prompt, p)))
    if a.format == "genai":
        # genai stops at EOS: compare up to where the reference emitted it
        res["greedy_genai"] = agreement(want, genai_greedy(out, prompt, 32))
    if a.ppl_tokens:
        toks = file_tokens(ref, str(WIKI), "second-half", a.ppl_tokens)
        pr = evaluate(ref, toks, progress=False)["ppl"]
        po = evaluate(onx, toks, progress=False)["ppl"]
        res.update(ppl_ref=pr, ppl_onnx=po, ppl_rel_diff=abs(po - pr) / pr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
