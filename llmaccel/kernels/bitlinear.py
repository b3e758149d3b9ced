"""Triton BitLinear: RMSNorm + per-token int8 activation quantization + ternary matmul, one kernel.

The MatMul-free LM fusion: the normalised activations never reach memory. Each program owns
BLOCK_M tokens and BLOCK_N output channels (and, with split-K, one slice of the columns):
  1. statistics over the whole row of each of its tokens: the sum of squares (RMSNorm) and the
     absmax of the normalised row (the int8 scale). A row is a few KB and every program of a
     row block reads it again from L2; at decode this is cheap next to the weight bytes.
  2. the matmul: 2-bit weight bytes are loaded once per tile and unpacked into four planes
     (llmaccel/ops/bitlinear.py explains the interleave: plane s of a byte tile covers 16
     consecutive columns per 64-column block); the matching x columns are normalised and
     quantized on the fly, and int8 x int8 tl.dot accumulates in int32, exactly.
  3. the epilogue scales by 1 / inv (per token) and w_scale (per channel), adds the bias and
     stores in x's dtype; with split-K the fp32 partials are added atomically instead.
This kernel serves prefill and decode batches above GEMV_ROWS tokens (BLOCK_M = 16: tl.dot's
smallest M); a few tokens take the dp4a GEMV of bitlinear_gemv.py.
The roundings follow the reference (ops.rms_norm rounds the normalised row to x's dtype, then
the product with the norm weight to their common dtype; round half to even), so on fp32 input
the plain op matches the reference bit for bit and the fused one up to codes flipped by the
order of the sum of squares.

Custom ops llmaccel::bitlinear and llmaccel::rms_norm_bitlinear: CPU (and any non-CUDA device)
= the reference in llmaccel/ops/bitlinear.py, CUDA = this kernel.
"""
from __future__ import annotations

from typing import Optional

import torch

from llmaccel.kernels import cdiv, registered, sm_count
from llmaccel.kernels.bitlinear_gemv import GEMV_ROWS, bitlinear_gemv
from llmaccel.ops import bitlinear as ref

try:  # kernels are optional: every non-CUDA path works without triton
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - only where triton is absent
    triton = None
    tl = None

GEMV_MAX_M = 16


if triton is not None:
    @triton.jit
    def _load_h(x_ptr, g_ptr, rm, k, m_ok, stride_xm, K, rstd,
                HAS_NORM: tl.constexpr, HAS_G: tl.constexpr, G_ROUND: tl.constexpr):
        # The op's input h (fp32) at rows rm, columns k: x, or rms_norm(x) rounded as the reference.
        xv = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                     mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        h = xv.to(tl.float32)
        if HAS_NORM:
            h = (h * rstd[:, None]).to(xv.dtype).to(tl.float32)
            if HAS_G:
                g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                h = h * g[None, :]
                if G_ROUND:
                    h = h.to(xv.dtype).to(tl.float32)
        return h

    @triton.jit
    def _row_scales(x_ptr, g_ptr, rm, m_ok, stride_xm, K, eps, HAS_NORM: tl.constexpr,
                    HAS_G: tl.constexpr, G_ROUND: tl.constexpr, IEEE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
        """Per row of the tile: (1 / RMS of x (HAS_NORM; else 0), 127 / absmax of the normed row,
        the int8 scale of its activations)."""
        rs = tl.arange(0, BLOCK_S)
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if HAS_NORM:
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_S):
                k = k0 + rs
                xv = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                             mask=m_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
                ss += tl.sum(xv * xv, axis=1)
            if IEEE:
                ms = libdevice.div_rn(ss, tl.full((BLOCK_M,), K, tl.float32))
                rstd = libdevice.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), libdevice.sqrt_rn(ms + eps))
            else:
                rstd = 1.0 / tl.sqrt(ss / K + eps)
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_S):
            h = _load_h(x_ptr, g_ptr, rm, k0 + rs, m_ok, stride_xm, K, rstd, HAS_NORM, HAS_G, G_ROUND)
            amax = tl.maximum(amax, tl.max(tl.abs(h), axis=1))
        # inv decides which products h * inv land on a tie (k + 1/2): compiled `/` is an
        # approximate division, so the rounded division is spelled out (IEEE, as the reference).
        if IEEE:
            inv = libdevice.div_rn(tl.full((BLOCK_M,), 127.0, tl.float32), tl.maximum(amax, 1e-5))
        else:
            inv = 127.0 / tl.maximum(amax, 1e-5)
        return rstd, inv

    @triton.jit
    def _bitlinear_kernel(x_ptr, g_ptr, wp_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, KB, K_PER,
                          stride_xm, eps, HAS_NORM: tl.constexpr, HAS_G: tl.constexpr,
                          G_ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                          IEEE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_S: tl.constexpr):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        # 1. per-token statistics over the whole row
        rstd, inv = _row_scales(x_ptr, g_ptr, rm, m_ok, stride_xm, K, eps, HAS_NORM, HAS_G, G_ROUND,
                                IEEE, BLOCK_M, BLOCK_S)
        # 2. ternary matmul over this program's columns
        rj = tl.arange(0, BLOCK_K // 4)                 # byte of the tile
        col0 = (rj // 16) * 64 + rj % 16                 # its plane-0 column within the tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for kk in range(0, K_PER, BLOCK_K):
            k0 = pid_k * K_PER + kk
            kb = k0 // 4 + rj
            byte = tl.load(wp_ptr + rn[:, None] * KB + kb[None, :],
                           mask=n_ok[:, None] & (kb < KB)[None, :], other=85)  # 85: four zeros
            for s in tl.static_range(4):
                h = _load_h(x_ptr, g_ptr, rm, k0 + col0 + 16 * s, m_ok, stride_xm, K, rstd,
                            HAS_NORM, HAS_G, G_ROUND)
                # round half to even as torch.round does: with c = 1.5 * 2^23, (v + c) - c
                # rounds |v| < 2^22 to an integer in IEEE arithmetic (|v| <= 127.5 here).
                # The product must be rounded to fp32 first, as the reference rounds it: a plain
                # multiply-add may be contracted into one FMA, which rounds the exact product and
                # so decides ties differently; 16-bit inputs hit exact ties (h / amax * 127 = k +
                # 1/2) often. mul_rn is a multiply the compiler may not fuse.
                if IEEE:
                    v = libdevice.mul_rn(h, inv[:, None])
                else:
                    v = h * inv[:, None]
                q = (v + 12582912.0) - 12582912.0
                q = tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int8)
                t = ((byte >> (2 * s)) & 3).to(tl.int8) - 1
                acc += tl.dot(q, tl.trans(t), out_dtype=tl.int32)
        # 3. epilogue
        ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        if IEEE:
            y = libdevice.div_rn(acc.to(tl.float32), inv[:, None]) * ws[None, :]
        else:
            y = acc.to(tl.float32) / inv[:, None] * ws[None, :]
        if HAS_BIAS:
            b = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            y += b[None, :] * (pid_k == 0).to(tl.float32)
        o = out_ptr + rm[:, None] * N + rn[None, :]
        om = m_ok[:, None] & n_ok[None, :]
        if ATOMIC:
            tl.atomic_add(o, y, mask=om)
        else:
            tl.store(o, y.to(out_ptr.dtype.element_ty), mask=om)


# The interpreter computes with numpy (IEEE roundings, no fused multiply-add) and has no
# libdevice; compiled code asks for IEEE roundings explicitly where the codes depend on them.
_INTERPRETED = triton is not None and type(_bitlinear_kernel).__name__ == "InterpretedFunction"


def default_config(M: int, N: int, K: int, n_sm: int) -> dict:
    """Tiles: decode (M <= 16) splits K until about two programs per SM; prefill does not."""
    kp = ref.padded_in(K)
    if M <= GEMV_MAX_M:
        cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, num_warps=4)
        while cdiv(N, 32) * cfg["SPLIT_K"] < 2 * n_sm and kp // (cfg["SPLIT_K"] * 2) >= 512:
            cfg["SPLIT_K"] *= 2
        return cfg
    return dict(BLOCK_M=32 if M <= 32 else 64, BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, num_warps=4)


def bitlinear_triton(x, w_packed, w_scale, bias=None, *, in_features: int, out_features: int,
                     norm_weight=None, eps: float | None = None, config: dict | None = None):
    """Triton bitlinear; with eps given, rms_norm_bitlinear (norm_weight may be None).

    `config` overrides the tile choice (benchmarks): BLOCK_M >= 16, BLOCK_N >= 16, BLOCK_K a
    multiple of 64, SPLIT_K, num_warps for the tensor-core kernel (any M); BLOCK_N, BLOCK_W
    (a power of two >= 4), num_warps for the GEMV (M <= GEMV_ROWS).
    """
    K, N = in_features, out_features
    if x.shape[-1] != K or tuple(w_packed.shape) != (N, ref.padded_in(K) // 4) \
            or tuple(w_scale.shape) != (N,) or w_packed.dtype != torch.uint8:
        raise ValueError(f"bitlinear: x {tuple(x.shape)}, w_packed {tuple(w_packed.shape)} "
                         f"{w_packed.dtype}, w_scale {tuple(w_scale.shape)}, in_features {K} and "
                         f"out_features {N} disagree")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if 0 < M <= GEMV_ROWS and (config is None or "BLOCK_W" in config):
        out = bitlinear_gemv(x2, w_packed, w_scale, bias, norm_weight, eps, K=K, N=N,
                             interpreted=_INTERPRETED, config=config)
        return out.reshape(*x.shape[:-1], N)
    cfg = dict(config or default_config(M, N, K, sm_count(x.device)))
    split = cfg.pop("SPLIT_K", 1)
    kp = ref.padded_in(K)
    k_per = cdiv(cdiv(kp, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = cdiv(kp, k_per)
    if split > 1:
        out = torch.zeros(M, N, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    has_norm, has_g = eps is not None, norm_weight is not None
    g_round = has_g and torch.promote_types(norm_weight.dtype, x.dtype) == x.dtype
    grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"]), split)
    _bitlinear_kernel[grid](
        x2, norm_weight if has_g else x2, w_packed, w_scale, bias if bias is not None else w_scale,
        out, M, N, K, kp // 4, k_per, x2.stride(0), float(eps or 0.0),
        HAS_NORM=has_norm, HAS_G=has_g, G_ROUND=g_round, HAS_BIAS=bias is not None,
        ATOMIC=split > 1, IEEE=not _INTERPRETED, BLOCK_S=256, **cfg)
    return out.to(x.dtype).reshape(*x.shape[:-1], N)


# --- custom ops: CPU = reference, CUDA = Triton ---------------------------------------------------


def _bitlinear_cuda(x, w_packed, w_scale, bias=None, *, in_features, out_features):
    if triton is None:
        return ref.bitlinear(x, w_packed, w_scale, bias, in_features=in_features,
                             out_features=out_features)
    return bitlinear_triton(x, w_packed, w_scale, bias, in_features=in_features,
                            out_features=out_features)


def _rms_norm_bitlinear_cuda(x, norm_weight, w_packed, w_scale, bias=None, *, eps, in_features,
                             out_features):
    if triton is None:
        return ref.rms_norm_bitlinear(x, norm_weight, w_packed, w_scale, bias, eps=eps,
                                      in_features=in_features, out_features=out_features)
    return bitlinear_triton(x, w_packed, w_scale, bias, in_features=in_features,
                            out_features=out_features, norm_weight=norm_weight, eps=eps)


if not registered("bitlinear"):
    @torch.library.custom_op("llmaccel::bitlinear", mutates_args=())
    def bitlinear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, *, in_features: int,
                  out_features: int) -> torch.Tensor:
        return ref.bitlinear(x, w_packed, w_scale, bias, in_features=in_features,
                             out_features=out_features)

    bitlinear.register_kernel("cuda")(_bitlinear_cuda)

    @bitlinear.register_fake
    def _bitlinear_fake(x, w_packed, w_scale, bias=None, *, in_features, out_features):
        return x.new_empty(*x.shape[:-1], out_features)

if not registered("rms_norm_bitlinear"):
    @torch.library.custom_op("llmaccel::rms_norm_bitlinear", mutates_args=())
    def rms_norm_bitlinear(x: torch.Tensor, norm_weight: Optional[torch.Tensor],
                           w_packed: torch.Tensor, w_scale: torch.Tensor,
                           bias: Optional[torch.Tensor] = None, *, eps: float, in_features: int,
                           out_features: int) -> torch.Tensor:
        return ref.rms_norm_bitlinear(x, norm_weight, w_packed, w_scale, bias, eps=eps,
                                      in_features=in_features, out_features=out_features)

    rms_norm_bitlinear.register_kernel("cuda")(_rms_norm_bitlinear_cuda)

    @rms_norm_bitlinear.register_fake
    def _rms_norm_bitlinear_fake(x, norm_weight, w_packed, w_scale, bias=None, *, eps, in_features,
                                 out_features):
        return x.new_empty(*x.shape[:-1], out_features)
