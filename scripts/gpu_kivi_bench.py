"""KIVI kernels on the GPU at Llama-3.2-1B decode shapes: correctness against the reference,
then timing against bf16 attention over an unquantized cache.

    python scripts/gpu_kivi_bench.py [--quick]

Shapes: 32 query heads, 8 KV heads, head_dim 64, G = 32, R = 128; batch 1/8/32, context
1k/4k/16k. Per shape: decode attention (KIVI 4- and 2-bit: packed prefix + bf16 residual) vs
torch SDPA on a bf16 cache (GQA), the bytes each must read and the bandwidth that implies, and
quantize-and-pack of a whole prefill. A short table is printed last; JSON goes to $OUT if set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmaccel.kernels import kivi  # noqa: E402
from llmaccel.ops import kvquant as ref  # noqa: E402

HQ, HKV, D, G, R = 32, 8, 64, 32, 128


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6  # GB/s, read + write


def make_cache(B, S, bits, dt):
    nq = G * ((S - R) // G)
    k = torch.randn(B * HKV, nq, D, device="cuda", dtype=dt) * 2
    v = torch.randn(B * HKV, nq, D, device="cuda", dtype=dt)
    kp, ks, km = torch.ops.llmaccel.kivi_quantize_keys(k, bits, G)
    vp, vs, vm = torch.ops.llmaccel.kivi_quantize_values(v, bits, G)
    view = lambda t: t.view(B, HKV, *t.shape[1:])  # noqa: E731
    kr = torch.randn(B, HKV, R + G, D, device="cuda", dtype=dt)
    vr = torch.randn(B, HKV, R + G, D, device="cuda", dtype=dt)
    cache = [view(t) for t in (kp, ks, km, vp, vs, vm)] + [kr, vr]
    n_quant = torch.full((B,), nq, device="cuda", dtype=torch.int32)
    n_res = torch.full((B,), S - nq, device="cuda", dtype=torch.int32)
    return cache, n_quant, n_res, nq


def kivi_bytes(B, S, nq, bits, dt_size=2) -> int:
    codes = 2 * nq * D * bits // 8
    meta = 2 * (nq // G) * D * dt_size + 2 * nq * (D // G) * dt_size
    return B * HKV * (codes + meta + 2 * (S - nq) * D * dt_size) + B * HQ * D * dt_size


def check(B, S, bits, dt) -> float:
    cache, nqt, nrt, _ = make_cache(B, S, bits, dt)
    q = torch.randn(B, HQ, D, device="cuda", dtype=dt)
    out = torch.ops.llmaccel.kivi_decode_attention(q, *cache, nqt, nrt, D ** -0.5, bits, G, G)
    exp = ref.decode_attention_ref(q, *cache, nqt, nrt, scale=D ** -0.5, bits=bits, group=G, value_group=G)
    return (out.float() - exp.float()).abs().max().item()


def run(quick: bool) -> dict:
    dt = torch.bfloat16
    rows, checks = [], []
    for bits in (4, 2):
        for B, S in ((1, 1024), (4, 4096)):
            err = check(B, S, bits, dt)
            checks.append({"bits": bits, "batch": B, "ctx": S, "max_abs_err": err, "ok": err < 2e-2})
    bw = copy_bandwidth()
    shapes = [(1, 4096), (8, 4096)] if quick else [(b, s) for b in (1, 8, 32) for s in (1024, 4096, 16384)]
    for B, S in shapes:
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=dt)
        kf = torch.randn(B, HKV, S, D, device="cuda", dtype=dt)
        vf = torch.randn_like(kf)
        t_bf16 = bench_ms(lambda: F.scaled_dot_product_attention(q, kf, vf, enable_gqa=True))
        bf16_bytes = 2 * kf.numel() * 2 + q.numel() * 2
        row = {"batch": B, "ctx": S, "bf16_us": 1e3 * t_bf16, "bf16_GBps": bf16_bytes / t_bf16 / 1e6}
        for bits in (4, 2):
            cache, nqt, nrt, nq = make_cache(B, S, bits, dt)
            qq = q[:, :, 0]
            t = bench_ms(lambda: torch.ops.llmaccel.kivi_decode_attention(
                qq, *cache, nqt, nrt, D ** -0.5, bits, G, G))
            nbytes = kivi_bytes(B, S, nq, bits)
            row[f"kv{bits}_us"] = 1e3 * t
            row[f"kv{bits}_GBps"] = nbytes / t / 1e6
            row[f"kv{bits}_speedup"] = t_bf16 / t
            row[f"kv{bits}_bytes_ratio"] = bf16_bytes / nbytes
            del cache
        # quantize-and-pack of a whole prefill of S tokens (keys and values)
        x = torch.randn(B * HKV, S, D, device="cuda", dtype=dt)
        tq = bench_ms(lambda: (torch.ops.llmaccel.kivi_quantize_keys(x, 4, G),
                               torch.ops.llmaccel.kivi_quantize_values(x, 4, G)))
        row["quant4_prefill_us"] = 1e3 * tq
        row["quant4_GBps"] = 2 * x.numel() * 2 / tq / 1e6
        rows.append(row)
        del kf, vf, x
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "copy_GBps": bw, "checks": checks, "rows": rows,
            "shape": {"n_heads": HQ, "n_kv_heads": HKV, "head_dim": D, "group": G, "residual": R}}


def table(res: dict) -> str:
    lines = [f"{res['device']}; copy bandwidth {res['copy_GBps']:.0f} GB/s; "
             f"checks: " + ", ".join(f"kv{c['bits']} B{c['batch']} {c['ctx']}: "
                                     f"{'ok' if c['ok'] else 'FAIL'} ({c['max_abs_err']:.1e})"
                                     for c in res["checks"]),
             "| batch | ctx | bf16 sdpa us | kv4 us (x, GB/s) | kv2 us (x, GB/s) | quant4 prefill us |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['batch']} | {r['ctx']} | {r['bf16_us']:.1f} | "
                     f"{r['kv4_us']:.1f} ({r['kv4_speedup']:.2f}x, {r['kv4_GBps']:.0f}) | "
                     f"{r['kv2_us']:.1f} ({r['kv2_speedup']:.2f}x, {r['kv2_GBps']:.0f}) | "
                     f"{r['quant4_prefill_us']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    a = ap.parse_args()
    if not torch.cuda.is_available() or not kivi.HAS_TRITON:
        print("needs a CUDA GPU and triton", file=sys.stderr)
        return 1
    res = run(a.quick)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kivi_bench.json").write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0 if all(c["ok"] for c in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
