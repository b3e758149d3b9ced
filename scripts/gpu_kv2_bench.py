"""Long-context decode through the paged runtime: a KIVI 2-bit KV cache against a bf16 one (the
issue's "KV2 vs bf16 KV, llama-1b bs64, prompt 4096" case).

    python scripts/gpu_kv2_bench.py [--model preset:llama-1b] [--batch 64] [--prompt 4096] [--gen 256]

The same requests (random prompt ids, greedy, no EOS) go through `LLM` twice: the source graph
(a full-precision cache in --dtype) and the graph compiled with `kvquant` (`--bits`, default 2). Decode tok/s counts
the output tokens produced after every request has its first token (prefill over), over that
time; the total counts every output token over the whole run. JSON goes to $OUT if set.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmaccel.bench.run import kernel_table  # noqa: E402
from llmaccel.compiler.pipeline import compile as compile_model  # noqa: E402
from llmaccel.runtime.engine import LLM  # noqa: E402
from llmaccel.runtime.sampler import SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_steps(llm, steps: int) -> dict:
    """Wall and GPU time of `steps` decode steps (all requests decoding), with the kernels that
    run in them: what the step spends on kernels, and on launches and host work. These steps
    are neither timed nor counted in `steps`."""
    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps * 1e3
    table = kernel_table(p, steps)
    table.pop("kernels")
    return {"steps": steps, "wall_ms_per_step": round(wall, 3), **table}


def run(kind: str, a) -> dict:
    passes, opts = ([], {}) if kind == "full" else (["kvquant"], {"kvquant": {"bits": str(a.bits)}})
    model = compile_model(a.model, passes, opts, dtype=a.dtype, device=a.device, eval_tokens=0,
                          progress=False)
    rng = random.Random(0)
    V = model.config.vocab_size
    prompts = [[rng.randrange(V) for _ in range(a.prompt)] for _ in range(a.batch)]
    llm = LLM(model, max_num_seqs=a.batch, max_num_batched_tokens=a.chunk,
              kv_cache_tokens=a.batch * (a.prompt + a.gen + 64))
    llm.generate([prompts[0][:64]] * 2, SamplingParams(max_tokens=4, ignore_eos=True))  # kernels
    sync(a.device)
    seqs = [llm.add_request(p, SamplingParams(max_tokens=a.gen, ignore_eos=True)) for p in prompts]
    t0 = time.perf_counter()
    all_first, prof = None, None
    steps = 0
    while not all(s.finished for s in seqs):
        llm.step()
        steps += 1
        if all_first is None and all(s.n_output > 0 for s in seqs):
            sync(a.device)
            if a.device == "cuda" and a.profile_steps:
                try:
                    prof = profile_steps(llm, a.profile_steps)
                except Exception as e:  # the profile is extra information
                    prof = {"error": f"{type(e).__name__}: {e}"[:200]}
            all_first = time.perf_counter()
            # requests admitted early have decoded while later ones were prefilling
            n_first = sum(s.n_output for s in seqs)
    sync(a.device)
    end = time.perf_counter()
    n_out = sum(s.n_output for s in seqs)
    if all_first is None:
        raise SystemExit(f"{kind}: some request never produced a token")
    c = model.config
    full_bytes = 2 * c.n_layers * c.n_kv_heads * c.head_dim * model.dtype.itemsize  # K and V
    bad = [s.id for s in seqs if s.error is not None or s.n_output != a.gen]
    res = dict(kind=kind, passes=passes, requests=a.batch, prompt=a.prompt, gen=a.gen,
               prefill_s=round(all_first - t0, 3), decode_s=round(end - all_first, 3),
               decode_tok_s=round((n_out - n_first) / (end - all_first), 1),
               total_output_tok_s=round(n_out / (end - t0), 1), steps=steps,
               kv_bytes_per_token=llm.metrics().get("kv_bytes_per_token", full_bytes), failed=bad,
               preemptions=llm.metrics().get("preemptions"), profile=prof)
    del llm, model
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="preset:llama-1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile-steps", type=int, default=4,
                    help="decode steps profiled once every request decodes (not timed); 0: none")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    rows = [run(k, a) for k in ("full", f"kv{a.bits}")]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kv2_bench.json").write_text(json.dumps(rows, indent=2))
    for r in rows:
        print(json.dumps(r))
    for r in rows:
        p = r.get("profile")
        if p and "error" not in p:
            print(f"{r['kind']}: step {p['wall_ms_per_step']} ms wall, {p['gpu_ms_per_step']:.3f} ms of kernels, "
                  f"{p['kernels_per_step']:.0f} kernels/step")
            for k in p["top_kernels"]:
                print(f"   {k['per_step']:6.1f} {k['ms']:8.3f} ms  {k['name']}")
    base = rows[0]["decode_tok_s"]
    print(f"\n| cache | prefill s | decode tok/s | x full | total out tok/s | KV bytes/token |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['prefill_s']} | {r['decode_tok_s']} | {r['decode_tok_s'] / base:.2f}x "
              f"| {r['total_output_tok_s']} | {r['kv_bytes_per_token']} |")
    return 0 if not any(r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
