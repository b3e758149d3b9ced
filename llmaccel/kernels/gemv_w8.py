"""gemv over int8 weights (linear_int8's codes, one scale per output row) with int8 activations,
one dp4a per int32 word of 4 weights. Not on the engine's path: its rounding of x per 128
columns costs W8 +0.3-0.9 points of ppl where W8 itself costs +0.1-0.8% (docs/quality.md), and
its speed is not measured yet; linear_w8a8 (x per row, after SmoothQuant) is what a W8A8 decode
GEMV must compute.

  llmaccel::gemv_int8(x, qweight, scales, bias=None, residual=None, *, eps=None, glu=False)
      y = s_n * sum_g d_g * sum_k q_nk c_k: x rounded to int8 codes c per group of 128 columns
      (d_g = amax / 127, as gemv_a8 rounds it), the weights' codes q exact, integer sums until
      the scales; the RMSNorm prologue, SiLU-mul and residual epilogues of kernels/gemv.py.

Like gemv_a8 (whose x rounding, split-K and epilogues it shares), it exists because the float
form of a weight-only GEMV spends ~10 instructions a weight byte and stalls on issue well below
the copy bandwidth; here a byte costs a quarter of a dp4a.
"""
from __future__ import annotations

import torch

from llmaccel.kernels import cdiv, pdl_enabled, registered, unit_stride
from llmaccel.kernels.gemv_a8 import gemv_a8_config, finish_ref, quantize_groups, split_buffers

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton
    triton = None

GS = 128  # columns of x per int8 scale


def gemv_int8_ref(x, qweight, scales, bias=None, residual=None, *, eps=None, glu=False):
    """The op's values: x rounded to int8 per group of GS, the weights' codes exact, fp32 sums."""
    N, K = qweight.shape
    G = cdiv(K, GS)
    codes, d = quantize_groups(x, GS, G)
    w = torch.nn.functional.pad(qweight.float(), (0, G * GS - K)).reshape(N, G, GS)
    y = (torch.einsum("...gk,ngk->...ng", codes, w) * d[..., None, :]).sum(-1) * scales.float()
    return finish_ref(y, x, bias, residual, eps, glu)


def _check(x, qweight, scales, bias, residual, glu) -> int:
    """Output width; raises ValueError on shapes the op does not take."""
    if qweight.dim() != 2 or qweight.dtype != torch.int8 or x.shape[-1] != qweight.shape[1] \
            or qweight.shape[1] % 4 or scales.shape != (qweight.shape[0],):
        raise ValueError(f"gemv_int8: x {tuple(x.shape)}, int8 qweight (N, K a multiple of 4) "
                         f"{tuple(qweight.shape)} {qweight.dtype} and scales {tuple(scales.shape)}")
    from llmaccel.kernels.gemv import _out_width
    return _out_width("gemv_int8", x, qweight.shape[0], bias, residual, glu)


if triton is not None:
    from llmaccel.kernels.gemv_a8 import _code, _pack4, _program_tile, _row_rstd, _split_out
    from llmaccel.kernels.gemv_kernels import _gemv_out
    from llmaccel.kernels.int_codes import dp4a
    from triton.language.extra import cuda as _tl_cuda
    from triton.language.extra import libdevice

    _GS = tl.constexpr(GS)  # a global a kernel reads must be a constexpr

    @triton.jit
    def _w8_tile(W, S, rows, n_ok, rg, KW):
        """Words (rows, groups, GS / 4) of int8 codes and the rows' scales."""
        rw = rg[:, None] * (_GS // 4) + tl.arange(0, _GS // 4)[None, :]
        w = tl.load(W + rows[:, None, None].to(tl.int64) * KW + rw[None], mask=n_ok[:, None, None]
                    & (rw < KW)[None], other=0)
        return w, tl.load(S + rows, mask=n_ok, other=0.0).to(tl.float32)

    @triton.jit
    def _w8_dot(w, s, xw, d, ASM: tl.constexpr):
        acc = dp4a(w, xw[None], tl.zeros(w.shape, tl.int32), ASM, True)
        return tl.sum(tl.sum(acc, 2).to(tl.float32) * d[None, :], 1) * s

    @triton.jit
    def _gemv_w8_kernel(X, W, S, BIAS, R, O, WS, CNT, M, N_OUT, K, KW, s_x, s_r, s_o, eps,
                        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
                        GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                        SPLIT: tl.constexpr, PDL: tl.constexpr, IEEE: tl.constexpr,
                        ASM: tl.constexpr):
        """Program (tile, ks) owns BLOCK_N rows over x's groups ks * BLOCK_G ...; its words are
        loaded before the wait for the kernel before."""
        m, tile, ks, rn, n_ok, rg = _program_tile(N_OUT, BLOCK_N, BLOCK_G, SPLIT)
        w, s = _w8_tile(W, S, rn, n_ok, rg, KW)
        wu, su = w, s
        if GLU:
            wu, su = _w8_tile(W, S, rn + N_OUT, n_ok, rg, KW)
        if PDL:
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()  # x (and the residual) come from the kernels before
        xrow = X + m.to(tl.int64) * s_x
        col = rg[:, None] * _GS + 4 * tl.arange(0, _GS // 4)[None, :]
        x0 = tl.load(xrow + col, mask=col < K, other=0.0).to(tl.float32)
        x1 = tl.load(xrow + col + 1, mask=col + 1 < K, other=0.0).to(tl.float32)
        x2 = tl.load(xrow + col + 2, mask=col + 2 < K, other=0.0).to(tl.float32)
        x3 = tl.load(xrow + col + 3, mask=col + 3 < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))), 1)
        if IEEE:
            inv = libdevice.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30))
        else:
            inv = 127.0 / tl.maximum(amax, 1e-30)
        iv = inv[:, None]
        xw = _pack4(_code(x0, iv, IEEE), _code(x1, iv, IEEE), _code(x2, iv, IEEE), _code(x3, iv, IEEE))
        d = amax / 127.0
        y = _w8_dot(w, s, xw, d, ASM)
        u = y
        if GLU:
            u = _w8_dot(wu, su, xw, d, ASM)
        if SPLIT > 1:
            _split_out(WS, CNT, y, u, rn, n_ok, m, M, tile, ks, xrow, K, eps, BIAS, R, O, N_OUT,
                       s_r, s_o, HAS_BIAS, HAS_RES, NORM, GLU, SPLIT)
        else:
            if NORM:
                r = _row_rstd(xrow, K, eps, 1024)
                y = y * r
                u = u * r
            _gemv_out(y, u, rn, n_ok, m, BIAS, R, O, N_OUT, s_r, s_o, HAS_BIAS, HAS_RES, GLU)


def gemv_int8_config(n_out: int, k: int, glu: bool, words: int | None = None, warps: int | None = None,
                     split: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_G, warps, programs per tile), chosen as gemv_a8_config chooses (untuned:
    twice the words of an int4 tile per column)."""
    return gemv_a8_config(n_out, cdiv(k, GS), GS, glu, words, warps, split, codes_per_word=4)


def gemv_int8_triton(x, qweight, scales, bias=None, residual=None, *, eps=None, glu=False,
                     num_warps=None, words=None, split=None, pdl=None, interpreted=None):
    n_out = _check(x, qweight, scales, bias, residual, glu)
    N, K = qweight.shape
    x2 = unit_stride(x.reshape(-1, K))
    M = x2.shape[0]
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    r = unit_stride(residual.reshape(M, n_out)) if residual is not None else None
    w = qweight.contiguous().view(torch.int32)
    bn, bg, num_warps, split = gemv_int8_config(n_out, K, glu, words, num_warps, split)
    ws, cnt, split, bn, bg, num_warps = split_buffers(
        x, out, M, N, split, (bn, bg, num_warps),
        lambda: gemv_int8_config(n_out, K, glu, words, num_warps, 1)[:3])
    if pdl is None:
        pdl = pdl_enabled(x)
    if interpreted is None:
        interpreted = not x.is_cuda
    _gemv_w8_kernel[(cdiv(n_out, bn) * split, M)](
        x2, w, scales, bias if bias is not None else out, r if r is not None else out, out, ws, cnt,
        M, n_out, K, w.shape[1], x2.stride(0), r.stride(0) if r is not None else 0, out.stride(0),
        float(eps) if eps is not None else 0.0, HAS_BIAS=bias is not None, HAS_RES=r is not None,
        NORM=eps is not None, GLU=glu, BLOCK_N=bn, BLOCK_G=bg, SPLIT=split, PDL=pdl,
        IEEE=not interpreted, ASM=not interpreted, num_warps=num_warps,
        **({"launch_pdl": True} if pdl else {}))
    return out.reshape(*x.shape[:-1], n_out)


if not registered("gemv_int8"):
    @torch.library.custom_op("llmaccel::gemv_int8", mutates_args=())
    def gemv_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, *,
                  eps: float | None = None, glu: bool = False) -> torch.Tensor:
        """linear_int8 at decode rows with x rounded to int8; see the module."""
        _check(x, qweight, scales, bias, residual, glu)
        return gemv_int8_ref(x, qweight, scales, bias, residual, eps=eps, glu=glu)

    @gemv_int8.register_fake
    def _(x, qweight, scales, bias=None, residual=None, *, eps=None, glu=False):
        return x.new_empty((*x.shape[:-1], _check(x, qweight, scales, bias, residual, glu)))

    if triton is not None:
        @gemv_int8.register_kernel("cuda")
        def _(x, qweight, scales, bias=None, residual=None, *, eps=None, glu=False):
            return gemv_int8_triton(x, qweight, scales, bias, residual, eps=eps, glu=glu)
