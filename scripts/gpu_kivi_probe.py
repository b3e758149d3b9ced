"""Per-layer decode attention at long context on the GPU: the static bf16 cache's kernel against
the static KIVI kernel (llmaccel/kernels/static_kivi.py) at its block sizes, split counts and
warps, with the bytes each reads and the bandwidth it reaches.

    python scripts/gpu_kivi_probe.py [--batch 64] [--ctx 4224] [--out results.json]

Shapes of preset:llama-1b (32 query heads, 8 KV heads of 64 channels), KV2 as the kvquant pass
makes it at 2 bits (groups of 16 tokens and 16 channels, 128 recent tokens exact).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmaccel.bench.run import cuda_time_us  # noqa: E402
from llmaccel.kernels import static_attention as sa  # noqa: E402
from llmaccel.kernels import static_kivi as sk  # noqa: E402
from llmaccel.ops.kvquant import bytes_per_token, make_spec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4224, help="position of the decoded token")
    ap.add_argument("--heads", default="32,8,64")
    ap.add_argument("--configs", default="", help="block_n:programs_per_sm:warps:prefetch,...")
    ap.add_argument("--out")
    a = ap.parse_args()
    H, Hkv, D = (int(x) for x in a.heads.split(","))
    B, P, dev, dt = a.batch, a.ctx, "cuda", torch.bfloat16
    max_len = P + 128
    q = torch.randn(B, H, D, device=dev, dtype=dt)
    k = torch.randn(B, Hkv, D, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, D, device=dev, dtype=dt)
    pos = torch.tensor([P], device=dev)
    rows = []
    kc = torch.randn(B, Hkv, max_len, D, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    nbytes = 2 * B * Hkv * (P + 1) * D * 2
    for splits in (None, 2, 4):
        us = cuda_time_us(lambda: sa.static_decode_triton(q, k, v, kc, vc, pos, D ** -0.5, num_splits=splits))
        rows.append({"kernel": "static bf16", "splits": splits, "us": us, "bytes": nbytes,
                     "tb_s": nbytes / us / 1e6})
    del kc, vc
    spec = make_spec(2, 16, 128, D)
    shapes = sk.cache_shapes(B, Hkv, D, max_len, spec)
    cache = []
    for n in sk.CACHE_NAMES:
        if n in ("kp", "vp"):
            cache.append(torch.randint(0, 256, shapes[n], device=dev, dtype=torch.uint8))
        else:
            cache.append((torch.rand(shapes[n], device=dev) * 0.1).to(dt))
    kw = dict(scale=D ** -0.5, bits=2, group=16, value_group=spec["value_group"], residual=128)
    ref = sk.static_kivi_decode_ref(q, k, v, *[t.clone() for t in cache], pos, **kw)
    kbytes = B * bytes_per_token(spec, Hkv, D) * (P + 1)
    base = dict(block_n=128, programs_per_sm=4, num_warps=4, prefetch=True)
    configs = [base, dict(base, prefetch=False),
               dict(base, pdl=False), dict(base, programs_per_sm=8), dict(base, programs_per_sm=8, prefetch=False),
               dict(base, block_n=64, programs_per_sm=8), dict(base, programs_per_sm=2),
               dict(base, block_n=64, programs_per_sm=16, num_warps=2)]
    if a.configs:
        keys = ("block_n", "programs_per_sm", "num_warps", "prefetch")
        configs = [dict(base, **dict(zip(keys, (int(x) for x in c.split(":"))))) for c in a.configs.split(",")]
    for cfg in configs:
        run = {k: v for k, v in cfg.items() if k != "pdl"}
        os.environ["LLMACCEL_PDL"] = "0" if cfg.get("pdl") is False else "1"
        try:
            out = sk.static_kivi_triton(q, k, v, *cache, pos, **kw, **run)
            err = (out.float() - ref.float()).abs().max().item()
            us = cuda_time_us(lambda: sk.static_kivi_triton(q, k, v, *cache, pos, **kw, **run))
            rows.append({"kernel": "static KIVI 2-bit", **cfg, "us": us, "bytes": kbytes,
                         "tb_s": kbytes / us / 1e6, "max_err": err})
        except Exception as e:  # a configuration that does not compile is reported, not fatal
            rows.append({"kernel": "static KIVI 2-bit", **cfg, "error": f"{type(e).__name__}: {e}"[:300]})
    if a.out:
        Path(a.out).write_text(json.dumps({"batch": B, "ctx": P, "heads": [H, Hkv, D], "rows": rows}, indent=1))
    print(f"decode attention per layer, batch {B}, position {P}, heads {H}/{Hkv}x{D} (bf16)")
    for r in rows:
        cfg = ", ".join(f"{k}={r[k]}" for k in ("splits", "block_n", "programs_per_sm", "num_warps", "prefetch", "pdl") if k in r)
        if "error" in r:
            print(f"  {r['kernel']:<18} {cfg:<60} ERROR {r['error'][:120]}")
        else:
            print(f"  {r['kernel']:<18} {cfg:<60} {r['us']:8.1f} us  {r['bytes'] / 1e6:7.1f} MB  "
                  f"{r['tb_s']:5.2f} TB/s" + (f"  err {r['max_err']:.1e}" if "max_err" in r else ""))


if __name__ == "__main__":
    main()
