"""Triton kernels for linear_int8 (int8 codes, one scale per output row), and its CPU form.

The GEMV streams the codes as int32 words (4 codes each), each turned into an exact fp32 integer
by a bit trick (int_codes.byte); rows past GEMV_MAX_M, or K not a multiple of 4, take the
tensor-core kernel. Tiles: quant_linear_configs.py. Registered as llmaccel::linear_int8: the
reference (llmaccel/ops/quant.py) on any device, Triton on CUDA, aten's int8 GEMM on the CPU.
"""
from __future__ import annotations

from typing import Optional

import torch

from llmaccel.kernels import cdiv, device_name, registered, sm_count
from llmaccel.kernels.int_codes import (cpu_act_dtype, finish, int8_codes_cpu, int8_mm_cpu, out_buffer,
                                        packed_words, rows_of, w8a8_mm_cpu)
from llmaccel.kernels.quant_linear_configs import GEMV_MAX_M, _pow2, int8_config
from llmaccel.ops import quant as ref

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference paths work without triton
    triton = None

if triton is not None:  # int_codes defines its jit building blocks only with triton
    from llmaccel.kernels.int_codes import byte, epilogue


if triton is not None:
    @triton.jit
    def _int8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, K, KW, WPS, stride_xm,
                          ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_W: tl.constexpr, EVEN_K: tl.constexpr, UNPACK: tl.constexpr,
                          HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rw = tl.arange(0, BLOCK_W)
        rk = tl.arange(0, BLOCK_W * 4)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_lo = pid_k * WPS
        for w0 in range(w_lo, w_lo + WPS, BLOCK_W):
            wi = w0 + rw
            w = tl.load(w_ptr + rn[:, None] * KW + wi[None, :], mask=n_ok[:, None] & (wi < KW)[None, :],
                        other=0)
            wh = w >> 16  # bytes 2, 3 would reach the exponent bits in place
            b0 = byte(w, 0xFF, 0x4B000080, 1.0)
            b1 = byte(w, 0xFF00, 0x4B008000, 0.00390625)
            b2 = byte(wh, 0xFF, 0x4B000080, 1.0)
            b3 = byte(wh, 0xFF00, 0x4B008000, 0.00390625)
            if UNPACK == 0:
                q = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BLOCK_N, BLOCK_W * 4))
            for m in tl.static_range(ROWS):
                if UNPACK == 0:
                    k = w0 * 4 + rk
                    km = (k < KW * 4) if EVEN_K else (k < K)
                    xv = tl.load(x_ptr + m * stride_xm + k, mask=km, other=0.0).to(tl.float32)
                    part = tl.sum(q * xv[None, :], axis=1)
                else:
                    k = wi * 4
                    xp = x_ptr + m * stride_xm + k
                    x0 = tl.load(xp, mask=k < K, other=0.0).to(tl.float32)
                    x1 = tl.load(xp + 1, mask=k + 1 < K, other=0.0).to(tl.float32)
                    x2 = tl.load(xp + 2, mask=k + 2 < K, other=0.0).to(tl.float32)
                    x3 = tl.load(xp + 3, mask=k + 3 < K, other=0.0).to(tl.float32)
                    part = tl.sum(b0 * x0[None, :] + b1 * x1[None, :] + b2 * x2[None, :]
                                  + b3 * x3[None, :], axis=1)
                if ROWS == 1:
                    acc += part[None, :]
                else:
                    acc = tl.where(rm[:, None] == m, acc + part[None, :], acc)
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        epilogue(acc, b_ptr, out_ptr, rm, rn, ROWS, N, HAS_BIAS, ATOMIC)

    @triton.jit
    def _int8_dot_kernel(x_ptr, qw_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr, HAS_BIAS: tl.constexpr):
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
        epilogue(acc, b_ptr, out_ptr, rm, rn, M, N, HAS_BIAS, False)


def linear_int8_triton(x, qweight, scales, bias=None, *, config=None):
    N, K = qweight.shape
    if x.shape[-1] != K or scales.shape != (N,):
        raise ValueError(f"linear_int8: qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)} "
                         f"and in_features {x.shape[-1]} disagree")
    x2 = rows_of(x, K)
    M = x2.shape[0]
    if M == 0:
        return ref.linear_int8(x, qweight, scales, bias)
    cfg = dict(config) if config is not None else int8_config(M, N, K, sm_count(x.device),
                                                              device_name(x.device))
    kernel = cfg.pop("kernel", "gemv")
    if kernel == "gemv" and (M > GEMV_MAX_M or K % 4):
        kernel, cfg = "dot", {k: v for k, v in int8_config(max(M, GEMV_MAX_M + 1), N, K, sm_count(x.device)).items()
                              if k != "kernel"}
    split = cfg.pop("SPLIT_K", 1) if kernel == "gemv" else 1
    scales = scales.contiguous()
    if kernel == "gemv":
        kw = K // 4
        wps = cdiv(cdiv(kw, split), cfg["BLOCK_W"]) * cfg["BLOCK_W"]  # words per split
        split = cdiv(kw, wps)
        out = out_buffer(M, N, x, split)
        has_bias = bias is not None and split == 1
        _int8_gemv_kernel[(cdiv(N, cfg["BLOCK_N"]), split)](
            x2, packed_words(qweight), scales, bias if has_bias else out, out, N, K, kw, wps, x2.stride(0),
            ROWS=M, BLOCK_M=_pow2(M), EVEN_K=True, HAS_BIAS=has_bias, ATOMIC=split > 1, **cfg)
    else:
        cfg.pop("UNPACK", None)
        out = out_buffer(M, N, x, 1)
        has_bias = bias is not None
        grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"]))
        _int8_dot_kernel[grid](x2, qweight.contiguous(), scales, bias if has_bias else out, out, M, N, K,
                               x2.stride(0), IEEE=x.dtype == torch.float32, HAS_BIAS=has_bias, **cfg)
    return finish(out, x, bias, split)


def _linear_int8_cuda(x, qweight, scales, bias=None):
    if triton is None:
        return ref.linear_int8(x, qweight, scales, bias)
    return linear_int8_triton(x, qweight, scales, bias)


def linear_int8_cpu(x, qweight, scales, bias=None):
    # aten's int8 weight-only GEMM reads the int8 codes directly: about 1.8x bf16 F.linear at
    # batch 1 on a 2-core CPU, where the reference dequantizes the whole weight on every call
    # (4x slower than bf16). Products are summed in fp32 and scaled once per row, so it
    # matches the reference up to fp32 rounding (and the reference's rounding of the
    # dequantized weight to x's dtype).
    # Its bf16 path crashes for 4+ rows when in_features is not a multiple of 8 (torch 2.13):
    # such layers (none in the supported models) take the reference.
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or qweight.dtype != torch.int8 \
            or x.shape[-1] % 8:
        return ref.linear_int8(x, qweight, scales, bias)
    dt = cpu_act_dtype(x.dtype)   # bf16 for fp32 x: aten's fp32 path is ~14x slower
    x2 = x.reshape(-1, x.shape[-1]).to(dt)
    y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), qweight.contiguous(),
                                           scales.to(dt)).to(x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], qweight.shape[0])


if not registered("linear_int8"):
    @torch.library.custom_op("llmaccel::linear_int8", mutates_args=())
    def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return ref.linear_int8(x, qweight, scales, bias)

    linear_int8.register_kernel("cuda")(_linear_int8_cuda)
    linear_int8.register_kernel("cpu")(linear_int8_cpu)

    @linear_int8.register_fake
    def _linear_int8_fake(x, qweight, scales, bias=None):
        return x.new_empty(*x.shape[:-1], qweight.shape[0])


def prepare_int8_cpu(qweight, scales):
    """int8_codes_cpu's tensors for int8_mm_cpu, converted once at lowering (a conversion inside
    a compiled step is a pointwise node, which Inductor's lowering of the aten op does not take);
    None for anything but int8 codes (N, K) with floating-point scales."""
    return int8_codes_cpu(qweight, scales) if _int8_rows(qweight, scales) else None


def prepare_w8a8_cpu(qweight, scales, smooth):
    """(codes as a (K, N) view, fp32 smooth, fp32 scales) for w8a8_mm_cpu, once at lowering."""
    return (qweight.t(), smooth.float(), scales.float()) if _int8_rows(qweight, scales) else None


def _int8_rows(qweight, scales) -> bool:
    return qweight.dtype == torch.int8 and qweight.dim() == 2 and scales.is_floating_point()


# The lowering calls this form directly on the CPU (see quant_linear.CPU_FORMS).
CPU_FORMS = {"linear_int8": (prepare_int8_cpu, int8_mm_cpu, 2),
             "linear_w8a8": (prepare_w8a8_cpu, w8a8_mm_cpu, 3)}
