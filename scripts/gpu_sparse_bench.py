"""GPU bench: sparse down-projection (llmaccel::sparse_down, Triton) against the dense product.

Shapes: SmolLM2-135M (1536 -> 576) and Llama-3.2-1B (8192 -> 2048) down-projections, bf16.
Activations are ReLU outputs with each channel zero with probability --sparsity, independently
per token (a worst case for batches: real ReLU sparsity is correlated across tokens, so the
union of live channels grows more slowly than here). Default sparsities are the ones `relu`
measured on SmolLM2-135M (relu 0.61, drelu 0.80) plus 0.9.

    python scripts/gpu_sparse_bench.py [--sparsity 0.61 0.80 0.9] [--tokens 1 2 4 8 16 32 64]
Prints a table last; writes $OUT/sparse_down_bench.json if OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

SHAPES = {"smollm2-135m": (1536, 576), "llama-1b": (8192, 2048)}


def bench(fn, reps: int = 200) -> float:
    """Median microseconds per call (CUDA events, after warm-up)."""
    from llmaccel.bench.run import cuda_time_us

    return cuda_time_us(fn, reps=reps, warmup=10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.61, 0.80, 0.9])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    from llmaccel.kernels.sparse_down import sparse_down_triton

    dt = getattr(torch, a.dtype)
    rows = []
    for name, (K, N) in SHAPES.items():
        w_t = (0.02 * torch.randn(K, N, device="cuda")).to(dt)
        w = w_t.t().contiguous()  # the dense path reads the usual (N, K) layout through cuBLAS
        for s in a.sparsity:
            for M in a.tokens:
                x = torch.relu(torch.randn(M, K, device="cuda"))
                x = torch.where(torch.rand(M, K, device="cuda") < s, 0.0, x + 0.1).to(dt)
                live = (x != 0).any(0).float().mean().item()
                dense = bench(lambda: torch.nn.functional.linear(x, w))
                sparse = bench(lambda: sparse_down_triton(x, w_t))
                err = (sparse_down_triton(x, w_t).float() - x.float() @ w_t.float()).abs().max().item()
                rows.append({"model": name, "K": K, "N": N, "sparsity": s, "tokens": M,
                             "live_rows": round(live, 3), "dense_us": round(dense, 2),
                             "sparse_us": round(sparse, 2), "speedup": round(dense / sparse, 3),
                             "max_abs_err": err})
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "sparse_down_bench.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": a.dtype, "rows": rows}, f, indent=1)
    print(f"device {torch.cuda.get_device_name()}, {a.dtype}")
    print(f"{'model':<13} {'sparsity':>8} {'tokens':>6} {'live':>6} {'dense us':>9} {'sparse us':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['model']:<13} {r['sparsity']:>8.2f} {r['tokens']:>6} {r['live_rows']:>6.3f} "
              f"{r['dense_us']:>9.2f} {r['sparse_us']:>9.2f} {r['speedup']:>8.2f}")


if __name__ == "__main__":
    main()
