"""Static decode attention tilings on the GPU: microseconds per layer inside a CUDA graph.

Each case replays a CUDA graph of calls cycling over L caches (one per layer, as in a decode
step; scripts/gpu_quant_bench.py's timer) and reports the time per call: block of slots per iteration, warps, splits of the cache
(a split adds the reduce launch), with and without the RoPE prologue.

    PYTHONPATH=$PWD python scripts/gpu_attn_probe.py --out $OUT/attn_probe.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from llmaccel.codegen.lower import rope_tables
from llmaccel.kernels.static_attention import static_decode_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_quant_bench import time_graph  # noqa: E402

SHAPES = {"smollm2-135m": (1, 9, 3, 64, 30), "llama-1b": (1, 32, 8, 64, 16),
          "llama-1b-bs64": (64, 32, 8, 64, 16), "llama2-7b": (1, 32, 32, 128, 32)}


def time_case(B, H, Hkv, D, L, S, pos, rope, **kw) -> float:
    dev = "cuda"
    qkv = torch.randn(B, (H + 2 * Hkv) * D, device=dev, dtype=torch.bfloat16)
    q, k, v = (t.view(B, -1, D) for t in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    caches = [(torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16),
               torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)) for _ in range(L)]
    p = torch.tensor([pos], device=dev)
    cos, sin = rope_tables(D, 10000.0, None, S, dev) if rope else (None, None)

    def call(i):  # layer i's attention, on its own cache
        kc, vc = caches[i]
        return lambda: static_decode_triton(q, k, v, kc, vc, p, D ** -0.5, cos, sin, **kw)

    return time_graph(call, L) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attn_probe.json")
    ap.add_argument("--S", type=int, default=384)
    ap.add_argument("--pos", type=int, default=256)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    a = ap.parse_args()
    shapes = {n: SHAPES[n] for n in a.shapes.split(",")}
    rows = []
    for name, (B, H, Hkv, D, L) in shapes.items():
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
    for name in shapes:
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
