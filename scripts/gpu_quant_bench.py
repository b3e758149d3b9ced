"""GPU benchmark: int4 / int8 weight-only linear kernels against bf16 F.linear at batch 1.

Llama-3.2-1B matrices (in x out): 2048x8192 (gate/up), 8192x2048 (down), 2048x128256 (LM head).
Times are CUDA-graph replays (launch overhead excluded, as in a captured decode step), median
of triton.testing's runs. GB/s counts the bytes each kernel must read (weights, scales, zeros,
x) and write; "of copy" is that over the H200's measured 4.27 TB/s copy bandwidth.
Goal (issue 3): int4 GEMV >= 3x bf16 and >= 70% of copy bandwidth.

Also sweeps a few GEMV tilings for int4 and reports the best next to the default heuristic.
Usage: python scripts/gpu_quant_bench.py [--batch 1]; JSON goes to $OUT/quant_bench.json if set.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

COPY_BW = 4.27e12
SHAPES = [(2048, 8192), (8192, 2048), (2048, 128256)]
SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=nw)
         for bn in (4, 8, 16, 32) for bk in (128, 256, 512) for sk in (1, 2, 4, 8) for nw in (4, 8)]


def bench(fn) -> float:
    """Median seconds per call."""
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    if hasattr(tt, "do_bench_cudagraph"):
        ms = tt.do_bench_cudagraph(fn, rep=50)
    else:
        ms = tt.do_bench(fn, warmup=25, rep=100)
    return ms * 1e-3


def int4_inputs(N, K, gs=128):
    G = K // gs
    qw = torch.randint(0, 256, (N, G, gs // 2), dtype=torch.uint8, device="cuda")
    sc = (torch.rand(N, G, device="cuda") * 0.01).to(torch.bfloat16)
    zr = torch.randint(0, 256, (N, (G + 1) // 2), dtype=torch.uint8, device="cuda")
    return qw, sc, zr


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-sweep", action="store_true")
    a = ap.parse_args()
    from llmaccel.kernels import quant_linear as ql
    from llmaccel.ops import quant as ref

    torch.manual_seed(0)
    M, rows = a.batch, []
    for K, N in SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, sc, zr = int4_inputs(N, K)
        q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
        s8 = (torch.rand(N, device="cuda") * 0.01).to(torch.bfloat16)
        out_b = M * N * 2
        # correctness at this shape before timing
        got = ql.linear_int4_triton(x, qw, sc, zr, group_size=128)
        exp = ref.linear_int4(x.float(), qw, sc.float(), zr, group_size=128)
        err4 = ((got.float() - exp).abs().max() / exp.abs().max()).item()
        got8 = ql.linear_int8_triton(x, q8, s8)
        exp8 = ref.linear_int8(x.float(), q8, s8.float())
        err8 = ((got8.float() - exp8).abs().max() / exp8.abs().max()).item()

        t_bf16 = bench(lambda: F.linear(x, w))
        t_int4 = bench(lambda: ql.linear_int4_triton(x, qw, sc, zr, group_size=128))
        t_int8 = bench(lambda: ql.linear_int8_triton(x, q8, s8))
        best_cfg, t_best = None, t_int4
        if not a.no_sweep and M <= ql.GEMV_MAX_M:
            bm = ql._pow2(M)
            for cfg in SWEEP:
                cfg = dict(cfg, BLOCK_M=bm)
                try:
                    t = bench(lambda: ql.linear_int4_triton(x, qw, sc, zr, group_size=128, config=cfg))
                except Exception:  # a tiling that does not compile or fit: skip it
                    continue
                if t < t_best:
                    best_cfg, t_best = cfg, t
        b_bf16 = nbytes(w, x) + out_b
        b_int4 = nbytes(qw, sc, zr, x) + out_b
        b_int8 = nbytes(q8, s8, x) + out_b
        rows.append(dict(
            shape=f"{K}x{N}", batch=M, max_rel_err_int4=err4, max_rel_err_int8=err8,
            bf16_us=t_bf16 * 1e6, int4_us=t_int4 * 1e6, int8_us=t_int8 * 1e6,
            int4_best_us=t_best * 1e6, int4_best_config=best_cfg,
            default_config=ql.gemv_config(M, N, K) if M <= ql.GEMV_MAX_M else ql.gemm_config(M, N, K),
            speedup_int4=t_bf16 / t_int4, speedup_int4_best=t_bf16 / t_best, speedup_int8=t_bf16 / t_int8,
            bf16_copy_frac=b_bf16 / t_bf16 / COPY_BW, int4_copy_frac=b_int4 / t_int4 / COPY_BW,
            int4_best_copy_frac=b_int4 / t_best / COPY_BW, int8_copy_frac=b_int8 / t_int8 / COPY_BW,
            int4_gbps=b_int4 / t_int4 / 1e9, bf16_gbps=b_bf16 / t_bf16 / 1e9))

    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "quant_bench.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": COPY_BW, "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, batch {M}, CUDA-graph timings; % = of 4.27 TB/s copy")
    print(f"{'K x N':>12} | {'bf16 us':>8} {'%':>4} | {'int4 us':>8} {'x':>5} {'%':>4} | "
          f"{'best us':>8} {'x':>5} {'%':>4} | {'int8 us':>8} {'x':>5} {'%':>4} | err4    err8")
    for r in rows:
        print(f"{r['shape']:>12} | {r['bf16_us']:8.2f} {100 * r['bf16_copy_frac']:4.0f} | "
              f"{r['int4_us']:8.2f} {r['speedup_int4']:5.2f} {100 * r['int4_copy_frac']:4.0f} | "
              f"{r['int4_best_us']:8.2f} {r['speedup_int4_best']:5.2f} {100 * r['int4_best_copy_frac']:4.0f} | "
              f"{r['int8_us']:8.2f} {r['speedup_int8']:5.2f} {100 * r['int8_copy_frac']:4.0f} | "
              f"{r['max_rel_err_int4']:.1e} {r['max_rel_err_int8']:.1e}")
    for r in rows:
        if r["int4_best_config"]:
            print(f"best int4 tiling {r['shape']}: {r['int4_best_config']} (default {r['default_config']})")


if __name__ == "__main__":
    main()
