"""GEMV for the decode step at a few rows, with its neighbours fused (one launch per linear).

  llmaccel::gemv(x (..., K), weight (N, K), bias=None, residual=None, *, eps=None, glu=False)
      y = W x (+ bias), fp32 accumulation, one rounding to x's dtype at the end, and:
      eps:      x is first RMS-normalized (weightless: `fuse` folds the norm's scale into W);
                computed as (W x) * rsqrt(mean(x^2) + eps), the statistics in the same program
      glu:      W holds the gate rows then the up rows (`fuse`'s gate_up): out = silu(g) * u,
                (N / 2 outputs), each program reads the matching gate and up rows
      residual: out = residual + (the above): the residual add after o and down projections

A decode layer of a Llama-style model is then four GEMVs and its attention: the RMSNorms, the
SiLU-mul and the residual adds cost no launch of their own (at batch 1 a launch costs about
what a 2048 x 2048 GEMV does).

Each program owns BLOCK_N output rows over the whole K (BLOCK_K >= K, masked): it issues the
loads of its weight tile first, and only then waits for the previous kernel (programmatic
dependent launch, sm90+): weights do not depend on it, so their reads overlap the tail of the
kernel before, and the launch gap between them. The programs also let the next kernel launch
early (`gdc_launch_dependents`), so chains of these kernels stream the weights back to back.
Without PDL (older GPUs, the interpreter) the same kernel runs with the two calls compiled out.

  llmaccel::gemv_int4(x, qweight, scales, zeros, bias=None, residual=None, *, group_size,
                      eps=None, glu=False, act8=False)
      the same op with linear_int4's weights (MatMulNBits layout, ops/quant.py): codes are read
      as int32 words (8 per word) with their groups' scales and zero points before the wait,
      dequantized in registers (q - z exactly, by a magic-number FMA as in int_codes.py) and
      scaled once per (row, group): y = sum_g s_g * sum_k (q_k - z_g) x_k. Its programs are
      persistent (PROGRAMS_PER_SM): each reads x once and streams its row tiles two at a time.
      act8: x is rounded to int8 per group first and the products are integer dp4a
      (kernels/gemv_a8.py): about 1.5-1.9x faster on an H100, where the fp32 form stalls on
      instruction issue at half the copy bandwidth. `gemv_rewrites` asks for it in bf16/fp16
      graphs; fp32 graphs keep the exact form.

CPU implementation: the references.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmaccel.kernels import cdiv, pdl_enabled, registered, sm_count, unit_stride
from llmaccel.kernels.gemv_a8 import gemv_a8_ref
from llmaccel.kernels.int_codes import packed_words
from llmaccel.ops.quant import dequantize_int4

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton
    triton = None

# Weights per program (both tiles with glu) and warps: the best for chains of PDL-launched
# GEMVs (each reading the one before, as in a decode step) among 2-16K weights x 2/4/8 warps on
# the H200 for SmolLM2's layers: 4K x 4 warps, one program per row tile (alone and without
# PDL, 8 warps read faster at 4K, but in a chain their waiting dependents crowd the SMs;
# scripts/gpu_gemv_probe.py, docs/results/h200-2026-11-29-gemv-chains.json).
ELEMS, WARPS = 4096, 4
# Matrices of at least PERSIST_WEIGHTS weights (llama-1b's and llama2-7b's layers): persistent
# programs, PERSIST_PER_SM per SM, 8K weights x 4 warps per tile (chains: llama2-7b 3,355 ->
# 3,249 us, llama-1b 573 -> 566; SmolLM2's small matrices are slower that way: 192 -> 227+;
# docs/results/h200-2026-11-30-gemv-persist.json).
PERSIST_WEIGHTS = 1 << 22
PERSIST_PER_SM, PERSIST_ELEMS, PERSIST_WARPS = 4, 8192, 4
# Above this K a program would hold too large a tile in registers: the op stays correct but
# loops over K in chunks of this size (no prefetch before the wait).
MAX_BLOCK_K = 16384
# int4: int32 words (8 codes each) per program and warps; above MAX_WORDS_ROW words per row
# (K = 32768) the program loops over groups (no prefetch before the wait).
WORDS, WORDS_WARPS = 4096, 8
MAX_WORDS_ROW = 4096
# Persistent programs per SM of gemv_int4 (each loops over row tiles).
PROGRAMS_PER_SM = 2


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, *, eps: float | None = None,
             glu: bool = False) -> torch.Tensor:
    """The op's values, fp32 throughout and one rounding to x's dtype."""
    xf = x.float()
    y = xf @ weight.float().t()
    if eps is not None:
        y = y * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if bias is not None:
        y = y + bias.float()
    if glu:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def gemv_int4_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, *,
                  group_size: int, eps: float | None = None, glu: bool = False) -> torch.Tensor:
    """gemv_ref on the dequantized weight (fp32: (q - z) * s is exact there), its first K
    columns (a zero-padded last group, as linear_int4)."""
    w = dequantize_int4(qweight, scales, zeros, group_size, torch.float32)[:, : x.shape[-1]]
    return gemv_ref(x, w, bias, residual, eps=eps, glu=glu)


def _check_int4(x, qweight, scales, zeros, bias, residual, group_size, glu) -> int:
    """Output width; raises ValueError on shapes the op does not take."""
    if qweight.dim() != 3:
        raise ValueError(f"gemv_int4: qweight must be (N, groups, group_size / 2), got {tuple(qweight.shape)}")
    N, G, half = qweight.shape
    if 2 * half != group_size or group_size < 8 or group_size & (group_size - 1):
        raise ValueError(f"gemv_int4: group_size {group_size} (a power of two >= 8) and qweight "
                         f"{tuple(qweight.shape)} disagree")
    if not (G - 1) * group_size < x.shape[-1] <= G * group_size:
        raise ValueError(f"gemv_int4: x {tuple(x.shape)} and {G} groups of {group_size} disagree")
    if scales.shape != (N, G) or zeros.dim() != 2 or zeros.shape[0] != N or 2 * zeros.shape[1] < G:
        raise ValueError(f"gemv_int4: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} "
                         f"for qweight {tuple(qweight.shape)}")
    return _out_width("gemv_int4", x, N, bias, residual, glu)


def _check(x, weight, bias, residual, glu) -> int:
    """Output width; raises ValueError on shapes the op does not take."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree")
    return _out_width("gemv", x, weight.shape[0], bias, residual, glu)


def _out_width(op, x, n, bias, residual, glu) -> int:
    """Output width of n weight rows; raises ValueError on bias / residual / glu shapes."""
    if glu and n % 2:
        raise ValueError(f"{op}: glu needs an even number of weight rows, got {n}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{op}: bias {tuple(bias.shape)} for {n} weight rows")
    n_out = n // 2 if glu else n
    if residual is not None and residual.shape != (*x.shape[:-1], n_out):
        raise ValueError(f"{op}: residual {tuple(residual.shape)}, output {(*x.shape[:-1], n_out)}")
    return n_out


if triton is not None:
    from llmaccel.kernels.gemv_a8 import gemv_a8_triton
    from llmaccel.kernels.gemv_kernels import _gemv_int4_kernel, _gemv_kernel


def gemv_config(n_out: int, k: int, glu: bool, elems: int | None = None,
                warps: int | None = None, persist: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps): the whole K in one tile up to MAX_BLOCK_K, about `elems`
    weights per tile (gate and up tiles together with glu), at least one row."""
    block_k = min(max(16, triton.next_power_of_2(k)), MAX_BLOCK_K)
    elems = elems or (PERSIST_ELEMS if persist else ELEMS)
    tiles = 2 if glu else 1
    block_n = _pow2_floor(max(1, min(elems // (tiles * block_k), triton.next_power_of_2(n_out))))
    return block_n, block_k, warps or (PERSIST_WARPS if persist else WARPS)


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, *, eps: float | None = None, glu: bool = False,
                num_warps: int | None = None, elems: int | None = None,
                pdl: bool | None = None, programs: int | None = None) -> torch.Tensor:
    """programs: persistent programs (each loops over row tiles; whole K in one tile only), 0
    for one program per row tile, None for the op's choice (PERSIST_WEIGHTS)."""
    n_out = _check(x, weight, bias, residual, glu)
    K = weight.shape[1]
    if programs is None:
        big = weight.numel() >= PERSIST_WEIGHTS and x.is_cuda
        programs = PERSIST_PER_SM * sm_count(x.device) if big else 0
    persist = programs > 0 and K <= MAX_BLOCK_K
    x2, w = unit_stride(x.reshape(-1, K)), unit_stride(weight)
    if w is not weight:  # a copy: written by a kernel that does not let this one start early
        pdl = False
    M = x2.shape[0]
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    bias = unit_stride(bias) if bias is not None else None
    r = unit_stride(residual.reshape(M, n_out)) if residual is not None else None
    bn, bk, num_warps = gemv_config(n_out, K, glu, elems, num_warps, persist)
    if pdl is None:
        pdl = pdl_enabled(x)
    extra = {"launch_pdl": True} if pdl else {}
    tiles = cdiv(n_out, bn)
    _gemv_kernel[(min(tiles, programs) if persist else tiles, M)](
        x2, w, bias if bias is not None else w, r if r is not None else out, out, n_out, K,
        x2.stride(0), w.stride(0), r.stride(0) if r is not None else 0, out.stride(0),
        float(eps) if eps is not None else 0.0,
        HAS_BIAS=bias is not None, HAS_RES=r is not None, NORM=eps is not None, GLU=glu,
        BLOCK_N=bn, BLOCK_K=bk, ONE_CHUNK=K <= bk, PDL=pdl, PERSIST=persist,
        num_warps=num_warps, **extra)
    return out.reshape(*x.shape[:-1], n_out)


def gemv_int4_config(n_out: int, groups: int, group_size: int, glu: bool, words: int | None = None,
                     warps: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_G, warps): all groups in one tile up to MAX_WORDS_ROW words per row,
    about `words` int32 words per program (gate and up tiles together with glu), >= 1 row."""
    wpg = group_size // 8
    block_g = min(triton.next_power_of_2(groups), max(1, MAX_WORDS_ROW // wpg))
    tiles = 2 if glu else 1
    block_n = _pow2_floor(max(1, min((words or WORDS) // (tiles * block_g * wpg), n_out)))
    return block_n, block_g, warps or WORDS_WARPS


def gemv_int4_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, *, group_size: int,
                     eps: float | None = None, glu: bool = False, num_warps: int | None = None,
                     words: int | None = None, pdl: bool | None = None,
                     programs: int | None = None) -> torch.Tensor:
    """programs: persistent programs (None: PROGRAMS_PER_SM per SM; 0: one per row tile)."""
    n_out = _check_int4(x, qweight, scales, zeros, bias, residual, group_size, glu)
    G = qweight.shape[1]
    K = x.shape[-1]
    x2 = unit_stride(x.reshape(-1, K))
    M = x2.shape[0]
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    bias = unit_stride(bias) if bias is not None else None
    r = unit_stride(residual.reshape(M, n_out)) if residual is not None else None
    w = packed_words(qweight)
    s, z = scales.contiguous(), zeros.contiguous()
    if w.data_ptr() != qweight.data_ptr() or s is not scales or z is not zeros:
        pdl = False  # a copy: written by a kernel that does not let this one start early
    bn, bg, num_warps = gemv_int4_config(n_out, G, group_size, glu, words, num_warps)
    if pdl is None:
        pdl = pdl_enabled(x)
    extra = {"launch_pdl": True} if pdl else {}
    tiles = cdiv(n_out, bn)
    if programs is None:
        programs = PROGRAMS_PER_SM * (sm_count(x.device) if x.is_cuda else 2)
    _gemv_int4_kernel[(min(tiles, programs) if programs > 0 else tiles, M)](
        x2, w, s, z,
        bias if bias is not None else out, r if r is not None else out, out, n_out, K, G,
        zeros.shape[1], x2.stride(0), r.stride(0) if r is not None else 0, out.stride(0),
        float(eps) if eps is not None else 0.0, GS=group_size,
        HAS_BIAS=bias is not None, HAS_RES=r is not None, NORM=eps is not None, GLU=glu,
        BLOCK_N=bn, BLOCK_G=bg, ONE_CHUNK=G <= bg, PDL=pdl, num_warps=num_warps, **extra)
    return out.reshape(*x.shape[:-1], n_out)


if not registered("gemv"):
    @torch.library.custom_op("llmaccel::gemv", mutates_args=())
    def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, *, eps: float | None = None,
             glu: bool = False) -> torch.Tensor:
        """((RMS-normalized) x) W^T (+ bias), (silu(gate) * up,) (+ residual); see the module."""
        _check(x, weight, bias, residual, glu)
        return gemv_ref(x, weight, bias, residual, eps=eps, glu=glu)

    @gemv.register_fake
    def _(x, weight, bias=None, residual=None, *, eps=None, glu=False):
        n_out = _check(x, weight, bias, residual, glu)
        return x.new_empty((*x.shape[:-1], n_out))

    if triton is not None:
        @gemv.register_kernel("cuda")
        def _(x, weight, bias=None, residual=None, *, eps=None, glu=False):
            return gemv_triton(x, weight, bias, residual, eps=eps, glu=glu)


if not registered("gemv_int4"):
    @torch.library.custom_op("llmaccel::gemv_int4", mutates_args=())
    def gemv_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, *,
                  group_size: int, eps: float | None = None, glu: bool = False,
                  act8: bool = False) -> torch.Tensor:
        """gemv with linear_int4's weights; act8: x rounded to int8 per group (gemv_a8.py);
        see the module."""
        _check_int4(x, qweight, scales, zeros, bias, residual, group_size, glu)
        ref = gemv_a8_ref if act8 else gemv_int4_ref
        return ref(x, qweight, scales, zeros, bias, residual, group_size=group_size, eps=eps, glu=glu)

    @gemv_int4.register_fake
    def _(x, qweight, scales, zeros, bias=None, residual=None, *, group_size, eps=None, glu=False,
          act8=False):
        n_out = _check_int4(x, qweight, scales, zeros, bias, residual, group_size, glu)
        return x.new_empty((*x.shape[:-1], n_out))

    if triton is not None:
        @gemv_int4.register_kernel("cuda")
        def _(x, qweight, scales, zeros, bias=None, residual=None, *, group_size, eps=None, glu=False,
              act8=False):
            fn = gemv_a8_triton if act8 else gemv_int4_triton
            return fn(x, qweight, scales, zeros, bias, residual, group_size=group_size, eps=eps, glu=glu)
