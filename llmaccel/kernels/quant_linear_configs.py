"""Launch configurations for the linear_int4 / linear_int8 Triton kernels (quant_linear.py).

`TUNED` holds the best correct tiling measured per device name and (op, N, K, group size, batch bucket) by
`scripts/gpu_quant_bench.py` (H200; H100 at the fused shapes); other shapes get a heuristic chosen from the sm_90 SASS
of each variant (instructions per weight byte, registers, no spills) and the grid size. Pure
Python: no triton import, so the configs can be inspected and tested anywhere.
"""
from __future__ import annotations

from llmaccel.kernels import cdiv

GEMV_MAX_M = 16
# Rows up to which a call is a decode batch: TUNED's buckets (1, 4, 16, 64) cover them, and the
# tiles keep enough programs for every SM; above it a prefill's tiles (many rows each) apply.
DECODE_MAX_M = 64

# Measured best tiles per device name, then (op, N, K, group_size (0 for int8), batch bucket
# 1/4/16/64); lines printed by `scripts/gpu_quant_bench.py --sweep` ("TUNED[...][...] = ...") are
# pasted here. Another GPU gets the heuristics until it is swept.
TUNED: dict[str, dict] = {}
H200 = TUNED.setdefault("NVIDIA H200", {})
# NVIDIA H200, scripts/gpu_quant_bench.py (run 1: 130 s budget, batches 1,4,16; int4 batch-1
# entries from run 2: --batches 1 --budget 90 --ops int4)
H200[('int4', 8192, 2048, 128, 1)] = {'kernel': 'gemv', 'BLOCK_N': 8, 'BLOCK_G': 4, 'UNPACK': 0, 'SPLIT_K': 1, 'num_warps': 1, 'STAGES': 3}
H200[('int8', 8192, 2048, 0, 1)] = {'kernel': 'gemv', 'BLOCK_N': 8, 'BLOCK_W': 256, 'UNPACK': 0, 'SPLIT_K': 1, 'num_warps': 4}
H200[('int4', 2048, 8192, 128, 1)] = {'kernel': 'gemv', 'BLOCK_N': 4, 'BLOCK_G': 16, 'UNPACK': 0, 'SPLIT_K': 1, 'num_warps': 4}
H200[('int8', 2048, 8192, 0, 1)] = {'kernel': 'gemv', 'BLOCK_N': 4, 'BLOCK_W': 256, 'UNPACK': 0, 'SPLIT_K': 1, 'num_warps': 2}
H200[('int4', 128256, 2048, 128, 1)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_G': 1, 'SPLIT_K': 1, 'num_warps': 2, 'num_stages': 3, 'PREFETCH': False, 'XPERM': True}
H200[('int8', 128256, 2048, 0, 1)] = {'kernel': 'gemv', 'BLOCK_N': 8, 'BLOCK_W': 256, 'UNPACK': 0, 'SPLIT_K': 1, 'num_warps': 4}
H200[('int4', 2048, 2048, 128, 1)] = {'kernel': 'gemv', 'BLOCK_N': 4, 'BLOCK_G': 16, 'UNPACK': 0, 'SPLIT_K': 1, 'num_warps': 4}
H200[('int8', 2048, 2048, 0, 1)] = {'kernel': 'gemv', 'BLOCK_N': 4, 'BLOCK_W': 512, 'UNPACK': 0, 'SPLIT_K': 1, 'num_warps': 8}
H200[('int4', 512, 2048, 128, 1)] = {'kernel': 'gemv', 'BLOCK_N': 4, 'BLOCK_G': 16, 'UNPACK': 0, 'SPLIT_K': 1, 'num_warps': 4}
H200[('int8', 512, 2048, 0, 1)] = {'kernel': 'gemv', 'BLOCK_N': 4, 'BLOCK_W': 512, 'UNPACK': 0, 'SPLIT_K': 1, 'num_warps': 8}
H200[('int4', 8192, 2048, 128, 4)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 256, 'BLOCK_G': 1, 'SPLIT_K': 8, 'num_warps': 8, 'num_stages': 3, 'PREFETCH': False}
H200[('int8', 8192, 2048, 0, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H200[('int4', 2048, 8192, 128, 4)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 128, 'BLOCK_G': 1, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 3, 'PREFETCH': False}
H200[('int8', 2048, 8192, 0, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H200[('int4', 128256, 2048, 128, 4)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 256, 'BLOCK_G': 1, 'SPLIT_K': 1, 'num_warps': 8, 'num_stages': 3, 'PREFETCH': False}
H200[('int8', 128256, 2048, 0, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H200[('int4', 2048, 2048, 128, 4)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 128, 'BLOCK_G': 1, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 3, 'PREFETCH': False}
H200[('int8', 2048, 2048, 0, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H200[('int4', 512, 2048, 128, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_G': 4, 'SPLIT_K': 4, 'num_warps': 4, 'num_stages': 3}
H200[('int8', 512, 2048, 0, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H200[('int4', 8192, 2048, 128, 16)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 256, 'BLOCK_G': 1, 'SPLIT_K': 8, 'num_warps': 8, 'num_stages': 3, 'PREFETCH': False}
H200[('int8', 8192, 2048, 0, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H200[('int4', 2048, 8192, 128, 16)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 128, 'BLOCK_G': 1, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 3, 'PREFETCH': False}
H200[('int8', 2048, 8192, 0, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H200[('int4', 128256, 2048, 128, 16)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 256, 'BLOCK_G': 1, 'SPLIT_K': 1, 'num_warps': 8, 'num_stages': 3, 'PREFETCH': False}
H200[('int8', 128256, 2048, 0, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H200[('int4', 2048, 2048, 128, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_G': 4, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 3}
H200[('int8', 2048, 2048, 0, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H200[('int4', 512, 2048, 128, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_G': 4, 'SPLIT_K': 4, 'num_warps': 4, 'num_stages': 3}
H200[('int8', 512, 2048, 0, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3}

H100 = TUNED.setdefault("NVIDIA H100 80GB HBM3", {})
# NVIDIA H100 80GB HBM3, scripts/gpu_quant_bench.py --batches 16 --ops int4 --budget 120 (the
# fused shapes the engine runs; batch 4 likewise: docs/results/h100-2026-12-07-quant-bench-b{4,16}.json)
H100[('int4', 16384, 2048, 128, 16)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_G': 1, 'SPLIT_K': 1, 'num_warps': 2, 'num_stages': 3, 'PREFETCH': False, 'XPERM': True}
H100[('int8', 16384, 2048, 0, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 3072, 2048, 128, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 32, 'BLOCK_G': 2, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 3}
H100[('int8', 3072, 2048, 0, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 2048, 8192, 128, 16)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_G': 1, 'SPLIT_K': 8, 'num_warps': 2, 'num_stages': 3, 'PREFETCH': False, 'XPERM': True}
H100[('int8', 2048, 8192, 0, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 128256, 2048, 128, 16)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_G': 1, 'SPLIT_K': 1, 'num_warps': 2, 'num_stages': 3, 'PREFETCH': False, 'XPERM': True}
H100[('int8', 128256, 2048, 0, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 2048, 2048, 128, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_G': 4, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 3}
H100[('int8', 2048, 2048, 0, 16)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 16384, 2048, 128, 4)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_G': 1, 'SPLIT_K': 1, 'num_warps': 2, 'num_stages': 3, 'PREFETCH': False, 'XPERM': True}
H100[('int8', 16384, 2048, 0, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 3072, 2048, 128, 4)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_G': 1, 'SPLIT_K': 8, 'num_warps': 2, 'num_stages': 3, 'PREFETCH': False, 'XPERM': True}
H100[('int8', 3072, 2048, 0, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 2048, 8192, 128, 4)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_G': 1, 'SPLIT_K': 8, 'num_warps': 2, 'num_stages': 3, 'PREFETCH': False, 'XPERM': True}
H100[('int8', 2048, 8192, 0, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 128256, 2048, 128, 4)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 128, 'BLOCK_G': 1, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 3, 'PREFETCH': False, 'XPERM': True}
H100[('int8', 128256, 2048, 0, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 2048, 2048, 128, 4)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_G': 1, 'SPLIT_K': 8, 'num_warps': 2, 'num_stages': 3, 'PREFETCH': False, 'XPERM': True}
H100[('int8', 2048, 2048, 0, 4)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}
# batch 64: scripts/gpu_quant_bench.py --batches 64 --budget 150 (docs/results/h100-2026-12-07-quant-bench-b64.json)
H100[('int4', 16384, 2048, 128, 64)] = {'kernel': 'dot', 'BLOCK_M': 64, 'BLOCK_N': 128, 'BLOCK_G': 1, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 3}
H100[('int8', 16384, 2048, 0, 64)] = {'kernel': 'dot', 'BLOCK_M': 64, 'BLOCK_N': 64, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 3072, 2048, 128, 64)] = {'kernel': 'dot', 'BLOCK_M': 64, 'BLOCK_N': 32, 'BLOCK_G': 2, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 3}
H100[('int8', 3072, 2048, 0, 64)] = {'kernel': 'dot', 'BLOCK_M': 64, 'BLOCK_N': 16, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 2048, 8192, 128, 64)] = {'kernel': 'dotasm', 'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_G': 1, 'SPLIT_K': 8, 'num_warps': 2, 'num_stages': 3, 'PREFETCH': False, 'XPERM': True}
H100[('int8', 2048, 8192, 0, 64)] = {'kernel': 'dot', 'BLOCK_M': 64, 'BLOCK_N': 16, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 128256, 2048, 128, 64)] = {'kernel': 'dot', 'BLOCK_M': 64, 'BLOCK_N': 128, 'BLOCK_G': 1, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 3}
H100[('int8', 128256, 2048, 0, 64)] = {'kernel': 'dot', 'BLOCK_M': 64, 'BLOCK_N': 64, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 3}
H100[('int4', 2048, 2048, 128, 64)] = {'kernel': 'dot', 'BLOCK_M': 64, 'BLOCK_N': 16, 'BLOCK_G': 2, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 3}
H100[('int8', 2048, 2048, 0, 64)] = {'kernel': 'dot', 'BLOCK_M': 16, 'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def batch_bucket(M: int) -> int:
    return 1 if M <= 1 else 4 if M <= 4 else 16 if M <= 16 else 64


def _rows_for(row_words: int, N: int, n_sm: int, target_words: int = 2048) -> int:
    """Rows per program: a tile of about target_words int32 words (8 KB), fewer rows while that
    leaves under two programs per SM."""
    bn = max(1, min(16, target_words // row_words))
    bn = 1 << (bn.bit_length() - 1)
    while bn > 1 and cdiv(N, bn) < 2 * n_sm:
        bn //= 2
    return bn


def _split_for(programs: int, steps: int, n_sm: int) -> int:
    """Split K only when the row tiles alone leave most SMs idle (the split costs a memset and a
    cast kernel)."""
    split = 1
    while programs * split < n_sm and steps // (2 * split) >= 1:
        split *= 2
    return split


def int4_config(M: int, N: int, K: int, group_size: int, n_sm: int, asm: bool = False,
                device: str | None = None) -> dict:
    """Defaults chosen from sm_90 SASS of each variant (instructions per weight byte, registers,
    no spills); TUNED[device] holds what a sweep on that device measured. `asm`: bf16 on CUDA, where the
    PTX-dequantizing tensor-core kernel (about 7-9 instructions per weight byte against 11 for
    the fp32 GEMV) may be used."""
    # the sweeps measured decode batches (1-64 rows): their tiles do not describe a prefill
    hit = TUNED.get(device, {}).get(("int4", N, K, group_size, batch_bucket(M))) if M <= DECODE_MAX_M else None
    if hit is not None and (asm or hit["kernel"] != "dotasm"):
        return dict(hit)
    G = cdiv(K, group_size)
    if asm and M <= GEMV_MAX_M and (M > 1 or N >= 32768):
        bn, warps = (64, 2) if N <= 4096 else (128, 4)
        split = _split_for(cdiv(N, bn), G, n_sm)
        return dict(kernel="dotasm", BLOCK_M=16, BLOCK_N=bn, BLOCK_G=1, SPLIT_K=split,
                    num_warps=warps, num_stages=3)
    if M > GEMV_MAX_M:
        # prefill, and decode batches of 17-64 rows until a sweep fills TUNED's 64-row bucket:
        # tensor-core tiles of 128 rows (each weight tile dequantized once per 128 rows), 8 warps;
        # the best of 14 tilings on the H200 at 128 and 1,024 rows of llama-1b's shapes
        # (docs/results/h200-2026-12-03-int4-prefill.json). At 64 requests on the H100, 64-row
        # dotasm tiles with split-K to fill the SMs decoded at half the speed of these
        # (docs/results/h100-2026-12-07-llm-b64-tiles.jsonl).
        bm = 32 if M <= 32 else 64 if M <= 64 else 128
        return dict(kernel="dot", BLOCK_M=bm, BLOCK_N=128 if N >= 8192 else 64,
                    BLOCK_G=max(1, 64 // group_size), SPLIT_K=1, num_warps=8 if bm == 128 else 4,
                    num_stages=3)
    if M > 1:
        # The GEMV's per-row reductions cost more than the weight bytes from 2 rows on; tl.dot
        # with M padded to 16 dequantizes each code once whatever M is.
        bn = 16 if N <= 4096 else 32
        bg = max(1, min(_pow2(G), 256 // group_size))
        split = _split_for(cdiv(N, bn), cdiv(G, bg), n_sm)
        return dict(kernel="dot", BLOCK_M=16, BLOCK_N=bn, BLOCK_G=bg, SPLIT_K=split,
                    num_warps=4, num_stages=3)
    # H200 run 1, K = 2048: the best gemv tiles read 2048 columns (all of K) of 4 rows per step,
    # UNPACK=0, 8 words (32 codes) per thread; fewer than 4 rows per program did not pay
    bg = min(_pow2(G), max(1, 2048 // group_size))
    row_words = bg * group_size // 8
    bn = max(min(4, _pow2(N)), _rows_for(row_words, N, n_sm))
    split = _split_for(cdiv(N, bn), cdiv(G, bg), n_sm)
    warps = max(1, min(8, bn * row_words // 256))
    return dict(kernel="gemv", BLOCK_N=bn, BLOCK_G=bg, UNPACK=0, SPLIT_K=split, num_warps=warps)


def int8_config(M: int, N: int, K: int, n_sm: int, device: str | None = None) -> dict:
    hit = TUNED.get(device, {}).get(("int8", N, K, 0, batch_bucket(M))) if M <= DECODE_MAX_M else None
    if hit is not None:
        return dict(hit)
    if M > 2 or K % 4:
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        bn = 64 if M > GEMV_MAX_M else 16 if N <= 4096 else 32
        while M <= DECODE_MAX_M and bn > 16 and cdiv(N, bn) * cdiv(M, bm) < n_sm:  # decode: a tile per SM
            bn //= 2
        return dict(kernel="dot", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128 if M <= GEMV_MAX_M else 64,
                    num_warps=4, num_stages=3)
    kw = K // 4
    bw = min(_pow2(kw), 256)
    bn = _rows_for(bw, N, n_sm)
    split = _split_for(cdiv(N, bn), cdiv(kw, bw), n_sm)
    warps = max(1, min(8, bn * bw // 512))
    return dict(kernel="gemv", BLOCK_N=bn, BLOCK_W=bw, UNPACK=0, SPLIT_K=split, num_warps=warps)
