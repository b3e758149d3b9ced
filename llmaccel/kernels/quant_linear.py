"""Triton kernels for linear_int8 / linear_int4 (weights dequantized in registers).

Two paths per op: a GEMV for decode (M <= 16 rows), where the weight bytes dominate and each
program streams BLOCK_N weight rows along K (coalesced: a row's bytes are contiguous in the
MatMulNBits layout), optionally split along K with fp32 atomics so that small N still fills
the GPU; and a GEMM for prefill, tl.dot on tiles dequantized on the fly.
int4 bytes hold columns 2j (low nibble) and 2j+1 (high nibble): instead of interleaving the
nibbles the kernels read x's even and odd columns and do two half-width products.

Registered as torch.library custom ops llmaccel::linear_int8 / llmaccel::linear_int4: the CPU
(and any non-CUDA) implementation is the reference in llmaccel/ops/quant.py, CUDA runs Triton.
"""
from __future__ import annotations

from typing import Optional

import torch

from llmaccel.ops import quant as ref

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference paths work without triton
    triton = None

GEMV_MAX_M = 16


if triton is not None:
    @triton.jit
    def _linear_int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, KP, G, ZB,
                                 K_SPLIT, stride_xm, GS: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 ATOMIC: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rj = tl.arange(0, BLOCK_K // 2)
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, K_SPLIT, BLOCK_K):
            k0 = pid_k * K_SPLIT + kk
            ke = k0 + 2 * rj                                     # even column of each byte
            b = tl.load(qw_ptr + rn[:, None] * (KP // 2) + (k0 // 2 + rj)[None, :],
                        mask=n_ok[:, None] & (ke < KP)[None, :], other=0)
            g = ke // GS
            s = tl.load(s_ptr + rn[:, None] * G + g[None, :], mask=n_ok[:, None] & (g < G)[None, :],
                        other=0.0).to(tl.float32)
            zb = tl.load(z_ptr + rn[:, None] * ZB + (g // 2)[None, :],
                         mask=n_ok[:, None] & (g < G)[None, :], other=0)
            z = ((zb >> ((g % 2) * 4)[None, :]) & 0xF).to(tl.float32)
            w_lo = ((b & 0xF).to(tl.float32) - z) * s
            w_hi = ((b >> 4).to(tl.float32) - z) * s
            xm = (rm < M)[:, None]
            xe = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :], mask=xm & (ke < K)[None, :],
                         other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + rm[:, None] * stride_xm + (ke + 1)[None, :],
                         mask=xm & (ke + 1 < K)[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(xe[:, None, :] * w_lo[None, :, :] + xo[:, None, :] * w_hi[None, :, :], axis=2)
        o = out_ptr + rm[:, None] * N + rn[None, :]
        om = (rm < M)[:, None] & n_ok[None, :]
        if ATOMIC:
            tl.atomic_add(o, acc, mask=om)
        else:
            tl.store(o, acc, mask=om)

    @triton.jit
    def _linear_int4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, KP, G, ZB,
                                 stride_xm, GS: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, BLOCK_K // 2)
        n_ok, m_ok = rn < N, rm < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, KP, BLOCK_K):
            ke = k0 + 2 * rj
            b = tl.load(qw_ptr + rn[:, None] * (KP // 2) + (k0 // 2 + rj)[None, :],
                        mask=n_ok[:, None] & (ke < KP)[None, :], other=0)
            g = ke // GS
            s = tl.load(s_ptr + rn[:, None] * G + g[None, :], mask=n_ok[:, None] & (g < G)[None, :],
                        other=0.0).to(tl.float32)
            zb = tl.load(z_ptr + rn[:, None] * ZB + (g // 2)[None, :],
                         mask=n_ok[:, None] & (g < G)[None, :], other=0)
            z = ((zb >> ((g % 2) * 4)[None, :]) & 0xF).to(tl.float32)
            xe = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :],
                         mask=m_ok[:, None] & (ke < K)[None, :], other=0.0)
            xo = tl.load(x_ptr + rm[:, None] * stride_xm + (ke + 1)[None, :],
                         mask=m_ok[:, None] & (ke + 1 < K)[None, :], other=0.0)
            w_lo = (((b & 0xF).to(tl.float32) - z) * s).to(xe.dtype)
            w_hi = (((b >> 4).to(tl.float32) - z) * s).to(xe.dtype)
            if IEEE:  # fp32 inputs: no silent tf32
                acc += tl.dot(xe, tl.trans(w_lo), input_precision="ieee")
                acc += tl.dot(xo, tl.trans(w_hi), input_precision="ieee")
            else:
                acc += tl.dot(xe, tl.trans(w_lo))
                acc += tl.dot(xo, tl.trans(w_hi))
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _linear_int8_gemv_kernel(x_ptr, qw_ptr, s_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 ATOMIC: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, K_SPLIT, BLOCK_K):
            k = pid_k * K_SPLIT + kk + rk
            w = tl.load(qw_ptr + rn[:, None] * K + k[None, :], mask=n_ok[:, None] & (k < K)[None, :],
                        other=0).to(tl.float32)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                        mask=(rm < M)[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        o = out_ptr + rm[:, None] * N + rn[None, :]
        om = (rm < M)[:, None] & n_ok[None, :]
        if ATOMIC:
            tl.atomic_add(o, acc, mask=om)
        else:
            tl.store(o, acc, mask=om)

    @triton.jit
    def _linear_int8_gemm_kernel(x_ptr, qw_ptr, s_ptr, out_ptr, M, N, K, stride_xm,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 IEEE: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok, m_ok = rn < N, rm < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                        mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            w = tl.load(qw_ptr + rn[:, None] * K + k[None, :], mask=n_ok[:, None] & (k < K)[None, :],
                        other=0).to(x.dtype)  # |q| <= 127: exact in fp16/bf16
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


# --- launch configuration ------------------------------------------------------------------------

def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def gemv_config(M: int, N: int, K: int, n_sm: int = 132) -> dict:
    """Tile sizes for the decode path: about 4 programs per SM, splitting K when N is small."""
    bm = _pow2(M)
    bn = max(4, 32 // bm)                     # keep BLOCK_M * BLOCK_N * BLOCK_K/2 in registers
    bk = 256 if bm <= 2 else 128
    split = 1
    while triton_cdiv(N, bn) * split < 4 * n_sm and K // (split * 2) >= 4 * bk:
        split *= 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4)


def gemm_config(M: int, N: int, K: int) -> dict:
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _prep(x: torch.Tensor, N: int, split: int):
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = (torch.zeros if split > 1 else torch.empty)(M, N, device=x.device, dtype=torch.float32)
    return x2, M, out


def _finish(out, x, bias):
    out = out.to(x.dtype)
    if bias is not None:
        out += bias.to(x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def linear_int4_triton(x, qweight, scales, zeros, bias=None, *, group_size: int, config=None):
    """Triton linear_int4; `config` overrides the tile choice (benchmarks)."""
    N, G, half = qweight.shape
    K = x.shape[-1]
    if 2 * half != group_size or K > G * group_size or scales.shape != (N, G):
        raise ValueError(f"linear_int4: qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)}, "
                         f"group_size {group_size} and in_features {K} disagree")
    M0 = x.numel() // K
    gemv = M0 <= GEMV_MAX_M
    cfg = dict(config or (gemv_config(M0, N, G * group_size) if gemv else gemm_config(M0, N, K)))
    split = cfg.pop("SPLIT_K", 1) if gemv else 1
    x2, M, out = _prep(x, N, split)
    KP = G * group_size
    common = (x2, qweight, scales, zeros, out, M, N, K, KP, G, zeros.shape[1])
    if gemv:
        k_split = triton_cdiv(triton_cdiv(KP, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        grid = (triton_cdiv(N, cfg["BLOCK_N"]), split)
        _linear_int4_gemv_kernel[grid](*common, k_split, x2.stride(0), GS=group_size,
                                       ATOMIC=split > 1, **cfg)
    else:
        grid = (triton_cdiv(M, cfg["BLOCK_M"]), triton_cdiv(N, cfg["BLOCK_N"]))
        _linear_int4_gemm_kernel[grid](*common, x2.stride(0), GS=group_size,
                                       IEEE=x.dtype == torch.float32, **cfg)
    return _finish(out, x, bias)


def linear_int8_triton(x, qweight, scales, bias=None, *, config=None):
    N, K = qweight.shape
    if x.shape[-1] != K or scales.shape != (N,):
        raise ValueError(f"linear_int8: qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)} "
                         f"and in_features {x.shape[-1]} disagree")
    M0 = x.numel() // K
    gemv = M0 <= GEMV_MAX_M
    cfg = dict(config or (gemv_config(M0, N, K) if gemv else gemm_config(M0, N, K)))
    split = cfg.pop("SPLIT_K", 1) if gemv else 1
    x2, M, out = _prep(x, N, split)
    if gemv:
        cfg["BLOCK_K"] *= 2  # one byte per weight: twice the columns for the same bytes
        k_split = triton_cdiv(triton_cdiv(K, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        grid = (triton_cdiv(N, cfg["BLOCK_N"]), split)
        _linear_int8_gemv_kernel[grid](x2, qweight, scales, out, M, N, K, k_split, x2.stride(0),
                                       ATOMIC=split > 1, **cfg)
    else:
        grid = (triton_cdiv(M, cfg["BLOCK_M"]), triton_cdiv(N, cfg["BLOCK_N"]))
        _linear_int8_gemm_kernel[grid](x2, qweight, scales, out, M, N, K, x2.stride(0),
                                       IEEE=x.dtype == torch.float32, **cfg)
    return _finish(out, x, bias)


# --- custom ops: CPU = reference, CUDA = Triton ---------------------------------------------------

def _registered(name: str) -> bool:
    # A re-import (tests import this module afresh under the interpreter) must not register twice.
    try:
        getattr(torch.ops.llmaccel, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _linear_int4_cuda(x, qweight, scales, zeros, bias=None, group_size=128):
    if triton is None:
        return ref.linear_int4(x, qweight, scales, zeros, bias, group_size=group_size)
    return linear_int4_triton(x, qweight, scales, zeros, bias, group_size=group_size)


def _linear_int8_cuda(x, qweight, scales, bias=None):
    if triton is None:
        return ref.linear_int8(x, qweight, scales, bias)
    return linear_int8_triton(x, qweight, scales, bias)


if not _registered("linear_int4"):
    @torch.library.custom_op("llmaccel::linear_int4", mutates_args=())
    def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, group_size: int = 128) -> torch.Tensor:
        return ref.linear_int4(x, qweight, scales, zeros, bias, group_size=group_size)

    linear_int4.register_kernel("cuda")(_linear_int4_cuda)

    @linear_int4.register_fake
    def _linear_int4_fake(x, qweight, scales, zeros, bias=None, group_size=128):
        return x.new_empty(*x.shape[:-1], qweight.shape[0])

if not _registered("linear_int8"):
    @torch.library.custom_op("llmaccel::linear_int8", mutates_args=())
    def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return ref.linear_int8(x, qweight, scales, bias)

    linear_int8.register_kernel("cuda")(_linear_int8_cuda)

    @linear_int8.register_fake
    def _linear_int8_fake(x, qweight, scales, bias=None):
        return x.new_empty(*x.shape[:-1], qweight.shape[0])
