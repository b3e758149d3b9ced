"""Static decode attention tilings on the GPU: microseconds per layer inside a CUDA graph.

Each case replays a graph of L calls (one per layer, each on its own cache, as in a decode
step) and reports the time per call: block of slots per iteration, warps, splits of the cache
(a split adds the reduce launch), with and without the RoPE prologue.

    PYTHONPATH=$PWD python scripts/gpu_attn_probe.py --out $OUT/attn_probe.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from llmaccel.codegen.lower import rope_tables
from llmaccel.kernels.static_attention import static_decode_triton

SHAPES = {"smollm2-135m": (1, 9, 3, 64, 30), "llama-1b": (1, 32, 8, 64, 16),
          "llama-1b-bs64": (64, 32, 8, 64, 16)}


def time_case(B, H, Hkv, D, L, S, pos, rope, **kw) -> float:
    dev = "cuda"
    qkv = torch.randn(B, (H + 2 * Hkv) * D, device=dev, dtype=torch.bfloat16)
    q, k, v = (t.view(B, -1, D) for t in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    caches = [(torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16),
               torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)) for _ in range(L)]
    p = torch.tensor([pos], device=dev)
    cos, sin = rope_tables(D, 10000.0, None, S, dev) if rope else (None, None)

    def body():
        for kc, vc in caches:
            static_decode_triton(q, k, v, kc, vc, p, D ** -0.5, cos, sin, **kw)

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        body()  # compile / warm
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / L)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attn_probe.json")
    ap.add_argument("--S", type=int, default=384)
    ap.add_argument("--pos", type=int, default=256)
    a = ap.parse_args()
    rows = []
    for name, (B, H, Hkv, D, L) in SHAPES.items():
        for bn, nw, sp, rope in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 6), (False, True)):
            if (rope and ((bn, nw) != (64, 4) or sp == 6)) or (nw == 8 and bn != 128):
                continue
            try:
                us = time_case(B, H, Hkv, D, L, a.S, a.pos, rope, block_n=bn, num_warps=nw, num_splits=sp)
            except Exception as e:  # e.g. out of resources for a tiling
                us = None
                print(name, bn, nw, sp, rope, type(e).__name__, str(e)[:100])
            rows.append(dict(shape=name, block_n=bn, num_warps=nw, splits=sp, rope=rope, us=us))
    json.dump(rows, open(a.out, "w"), indent=1)
    for name in SHAPES:
        got = sorted((r for r in rows if r["shape"] == name and r["us"]), key=lambda r: r["us"])
        base = next(r for r in rows if r["shape"] == name and (r["block_n"], r["num_warps"], r["splits"],
                                                                r["rope"]) == (64, 4, 1, False))
        rope = next(r for r in rows if r["shape"] == name and (r["block_n"], r["num_warps"], r["splits"],
                                                                r["rope"]) == (64, 4, 1, True))
        print(f"{name}: default {base['us']:.2f} us, with rope {rope['us']:.2f} us; best:")
        for r in got[:5]:
            print(f"   bn {r['block_n']} warps {r['num_warps']} splits {r['splits']} rope {r['rope']}: {r['us']:.2f} us")


if __name__ == "__main__":
    main()
