"""Paged rope decode attention at serving shapes: time and bandwidth per launch config.

    python scripts/gpu_attn_probe.py [--out OUT/attn.json]

llama-1b's attention (32 heads, 8 KV heads, head_dim 64, blocks of 16), rows of contexts drawn
as the serving load's (prompt 128-1024 plus up to 512 generated), block tables scattered.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmaccel.kernels.paged_rope import paged_rope_decode_ref, paged_rope_decode_triton  # noqa: E402


def case(B, ctx_lo, ctx_hi, H=32, Hkv=8, D=64, BS=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(ctx_lo, ctx_hi + 1, (B,), generator=g)
    W = (ctx_hi + BS) // BS + 1
    nblk = B * W
    perm = torch.randperm(nblk, generator=g)
    tables = perm[: B * W].reshape(B, W).to(torch.int32)
    dev, dt = "cuda", torch.bfloat16
    kc = torch.randn(nblk, BS, Hkv, D, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    q = torch.randn(B, H + 2 * Hkv, D, device=dev, dtype=dt)
    pos = (ctx - 1).to(dev)
    t = torch.arange(ctx_hi + 8, device=dev, dtype=torch.float32)[:, None] * torch.ones(D, device=dev) * 1e-3
    return dict(q=q, kc=kc, vc=vc, pos=pos, tables=tables.to(dev), cos=t.cos().contiguous(),
                sin=t.sin().contiguous(), bytes=int(ctx.sum()) * Hkv * D * 2 * 2)


def timed(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * 10)  # us a launch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for B, lo, hi in ((64, 128, 384), (165, 256, 1536), (256, 256, 1536), (1, 128, 384), (1, 1024, 4096)):
        c = case(B, lo, hi)
        ref = paged_rope_decode_ref(c["q"], None, None, c["kc"].clone(), c["vc"].clone(), c["pos"],
                                    c["tables"], c["cos"], c["sin"], 0.125)
        for bn, w, st in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
            kc, vc = c["kc"].clone(), c["vc"].clone()

            def fn():
                return paged_rope_decode_triton(c["q"], None, None, kc, vc, c["pos"], c["tables"], c["cos"],
                                                c["sin"], 0.125, block_n=bn, num_warps=w, num_stages=st)
            try:
                err = (fn().float() - ref.float()).abs().max().item()
                us = timed(fn)
            except Exception as e:  # noqa: BLE001 - a config that does not compile
                rows.append(dict(B=B, ctx=(lo, hi), block_n=bn, warps=w, stages=st, error=str(e)[:100]))
                continue
            rows.append(dict(B=B, ctx=(lo, hi), block_n=bn, warps=w, stages=st, us=round(us, 2),
                             tb_s=round(c["bytes"] / us / 1e6, 3), err=err))
        best = min((r for r in rows if r["B"] == B and r["ctx"] == (lo, hi) and "us" in r), key=lambda r: r["us"])
        now = next(r for r in rows if r["B"] == B and r["ctx"] == (lo, hi) and r.get("block_n") == 64
                   and r["warps"] == 4 and r["stages"] == 3)
        print(f"B={B:4d} ctx {lo}-{hi}: now (64,4,3) {now.get('us')} us {now.get('tb_s')} TB/s; best "
              f"({best['block_n']},{best['warps']},{best['stages']}) {best['us']} us {best['tb_s']} TB/s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=0))


if __name__ == "__main__":
    main()
