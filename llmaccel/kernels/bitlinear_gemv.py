"""Decode-row BitLinear: the ternary GEMV for a few tokens, with dp4a integer dot products.

The tensor-core kernel in bitlinear.py pads every row block to 16 tokens, re-quantizes each
weight tile's x columns for 16 rows and splits K to fill the GPU: at one token it ran at 1-3% of
the copy bandwidth. Here one program owns (BLOCK_N output rows, one token):
  1. it issues the loads of its weight tile (whole K when it fits one chunk) before anything
     else, then waits for the kernel before (programmatic dependent launch, as kernels/gemv.py);
  2. the token's statistics (sum of squares for the RMSNorm, absmax of the normalised row) over
     its row, the scale inv = 127 / amax, all computed as the reference rounds them;
  3. per chunk of BLOCK_W int32 weight words, the token's int8 codes packed four to a word in
     the order the weight bytes hold their columns: byte b of word w, plane s (bits 2s, 2s + 1)
     is column 64 * (w // 4) + 16 * s + 4 * (w % 4) + b (ops/bitlinear.py's layout), so the
     x word for (w, s) is four consecutive columns;
  4. per weight word and plane: (w >> 2s) & 0x03030303 gives four codes t + 1 in {0, 1, 2}, and
     one dp4a (four int8 products added to an int32) takes them against the x word: 16 weights
     in 4 x (shift/and + dp4a) instructions. sum (t + 1) q - sum q = sum t q, exact in int32;
  5. y = acc / inv * w_scale (+ bias), stored in x's dtype.
The sums are exact integers and the codes equal the reference's, so the output matches the
reference bit for bit up to the order of the sum of squares (as the tensor-core kernel).

Under the Triton interpreter (no inline PTX) dp4a is spelled out on the same packed words, so
the CPU tests check the packing the GPU runs.
"""
from __future__ import annotations

import torch

from llmaccel.kernels import cdiv, pdl_enabled, sm_count
from llmaccel.ops import bitlinear as ref

try:
    import triton
    import triton.language as tl
    from triton.language.extra import cuda as _tl_cuda
    from triton.language.extra import libdevice

    from llmaccel.kernels.int_codes import dp4a
except ImportError:  # pragma: no cover - only where triton is absent
    triton = None

# Tokens up to which a call takes this kernel (each token reads the weight tile again, from L2
# after the first): decode batches of a few rows. Larger batches take the tensor-core kernel.
GEMV_ROWS = 4
# int32 weight words a program holds (two per SM at least, fewer rows per program until then)
# and words per K chunk (K up to 8,192 in one chunk).
WORDS, MAX_BLOCK_W = 4096, 512


if triton is not None:
    @triton.jit
    def _h(xrow, g_ptr, k, K, rstd, HAS_NORM: tl.constexpr, HAS_G: tl.constexpr,
           G_ROUND: tl.constexpr):
        """The op's input h (fp32) at columns k of one token, rounded as the reference rounds."""
        xv = tl.load(xrow + k, mask=k < K, other=0.0)
        h = xv.to(tl.float32)
        if HAS_NORM:
            h = (h * rstd).to(xv.dtype).to(tl.float32)
            if HAS_G:
                h = h * tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                if G_ROUND:
                    h = h.to(xv.dtype).to(tl.float32)
        return h

    @triton.jit
    def _code(h, inv, IEEE: tl.constexpr):
        """clamp(round_half_even(h * inv), -128, 127) as int32 (see bitlinear.py: the product is
        rounded on its own, never fused into an FMA)."""
        if IEEE:
            v = libdevice.mul_rn(h, inv)
        else:
            v = h * inv
        q = (v + 12582912.0) - 12582912.0
        return tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int32)

    @triton.jit
    def _x_word(xrow, g_ptr, kw, s: tl.constexpr, K, rstd, inv, HAS_NORM: tl.constexpr,
                HAS_G: tl.constexpr, G_ROUND: tl.constexpr, IEEE: tl.constexpr):
        """The token's codes for plane s of weight words kw, four per int32 (byte b: column
        64 * (kw // 4) + 16 * s + 4 * (kw % 4) + b), and their sum."""
        col = (kw // 4) * 64 + 16 * s + (kw % 4) * 4
        q0 = _code(_h(xrow, g_ptr, col, K, rstd, HAS_NORM, HAS_G, G_ROUND), inv, IEEE)
        q1 = _code(_h(xrow, g_ptr, col + 1, K, rstd, HAS_NORM, HAS_G, G_ROUND), inv, IEEE)
        q2 = _code(_h(xrow, g_ptr, col + 2, K, rstd, HAS_NORM, HAS_G, G_ROUND), inv, IEEE)
        q3 = _code(_h(xrow, g_ptr, col + 3, K, rstd, HAS_NORM, HAS_G, G_ROUND), inv, IEEE)
        word = (q0 & 0xFF) | ((q1 & 0xFF) << 8) | ((q2 & 0xFF) << 16) | (q3 << 24)
        return word, tl.sum((q0 + q1) + (q2 + q3), 0)

    @triton.jit
    def _planes(w, xrow, g_ptr, kw, acc, qsum, K, rstd, inv, HAS_NORM: tl.constexpr,
                HAS_G: tl.constexpr, G_ROUND: tl.constexpr, IEEE: tl.constexpr, ASM: tl.constexpr):
        """acc += the four planes of weight words w against the token's packed codes."""
        for s in tl.static_range(4):
            xw, qs = _x_word(xrow, g_ptr, kw, s, K, rstd, inv, HAS_NORM, HAS_G, G_ROUND, IEEE)
            acc = dp4a((w >> (2 * s)) & 0x03030303, tl.broadcast_to(xw[None, :], w.shape), acc, ASM)
            qsum += qs
        return acc, qsum

    @triton.jit
    def _bitlinear_gemv_kernel(x_ptr, g_ptr, wp_ptr, ws_ptr, b_ptr, out_ptr, N, K, KW, stride_xm,
                               stride_om, eps, HAS_NORM: tl.constexpr, HAS_G: tl.constexpr,
                               G_ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                               ASM: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr):
        pid, m = tl.program_id(0), tl.program_id(1)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rw = tl.arange(0, BLOCK_W)
        w_row = wp_ptr + rn[:, None].to(tl.int64) * KW
        w = tl.load(w_row + rw[None, :], mask=n_ok[:, None] & (rw < KW)[None, :], other=0)
        if PDL:
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()  # x comes from the kernels before
        xrow = x_ptr + m.to(tl.int64) * stride_xm
        rs = tl.arange(0, BLOCK_S)
        rstd = 0.0
        if HAS_NORM:
            ss = tl.zeros((BLOCK_S,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_S):
                xv = tl.load(xrow + k0 + rs, mask=k0 + rs < K, other=0.0).to(tl.float32)
                ss += xv * xv
            if IEEE:
                ms = libdevice.div_rn(tl.sum(ss, 0), tl.full((), K, tl.float32))
                rstd = libdevice.div_rn(tl.full((), 1.0, tl.float32), libdevice.sqrt_rn(ms + eps))
            else:
                rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
        amax = tl.zeros((BLOCK_S,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_S):
            amax = tl.maximum(amax, tl.abs(_h(xrow, g_ptr, k0 + rs, K, rstd, HAS_NORM, HAS_G, G_ROUND)))
        if IEEE:
            inv = libdevice.div_rn(tl.full((), 127.0, tl.float32), tl.maximum(tl.max(amax, 0), 1e-5))
        else:
            inv = 127.0 / tl.maximum(tl.max(amax, 0), 1e-5)
        acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32)
        qsum = tl.zeros((), dtype=tl.int32)
        acc, qsum = _planes(w, xrow, g_ptr, rw, acc, qsum, K, rstd, inv, HAS_NORM, HAS_G, G_ROUND,
                            IEEE, ASM)
        for kw0 in range(BLOCK_W, KW, BLOCK_W):  # K past one chunk (no prefetch before the wait)
            kw = kw0 + rw
            w = tl.load(w_row + kw[None, :], mask=n_ok[:, None] & (kw < KW)[None, :], other=0)
            acc, qsum = _planes(w, xrow, g_ptr, kw, acc, qsum, K, rstd, inv, HAS_NORM, HAS_G,
                                G_ROUND, IEEE, ASM)
        y = (tl.sum(acc, 1) - qsum).to(tl.float32)
        ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        if IEEE:
            y = libdevice.div_rn(y, inv) * ws
        else:
            y = y / inv * ws
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m.to(tl.int64) * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(M: int, N: int, K: int, n_sm: int, words: int = WORDS) -> dict:
    """(BLOCK_N, BLOCK_W, num_warps): whole K in one chunk up to MAX_BLOCK_W words a row, about
    `words` words a program, fewer rows while that leaves under two programs per SM."""
    kw = ref.padded_in(K) // 16
    bw = min(triton.next_power_of_2(kw), MAX_BLOCK_W)
    bn = max(1, min(words // bw, triton.next_power_of_2(N)))
    while bn > 1 and cdiv(N, bn) * M < 2 * n_sm:
        bn //= 2
    return dict(BLOCK_N=bn, BLOCK_W=bw, num_warps=4)


def bitlinear_gemv(x2, w_packed, w_scale, bias, norm_weight, eps, *, K: int, N: int,
                   interpreted: bool, config: dict | None = None) -> torch.Tensor:
    """(M, N) output in x2's dtype for M <= GEMV_ROWS tokens (x2: (M, K), unit column stride)."""
    M = x2.shape[0]
    cfg = dict(config or gemv_config(M, N, K, sm_count(x2.device)))
    out = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    has_norm, has_g = eps is not None, norm_weight is not None
    g_round = has_g and torch.promote_types(norm_weight.dtype, x2.dtype) == x2.dtype
    words = w_packed.view(torch.int32)   # (N, Kp / 16): Kp is a multiple of 64
    pdl = pdl_enabled(x2)
    extra = {"launch_pdl": True} if pdl else {}
    _bitlinear_gemv_kernel[(cdiv(N, cfg["BLOCK_N"]), M)](
        x2, norm_weight if has_g else x2, words, w_scale, bias if bias is not None else w_scale,
        out, N, K, words.shape[1], x2.stride(0), out.stride(0), float(eps or 0.0),
        HAS_NORM=has_norm, HAS_G=has_g, G_ROUND=g_round, HAS_BIAS=bias is not None,
        IEEE=not interpreted, ASM=not interpreted, PDL=pdl, BLOCK_S=1024, **cfg, **extra)
    return out
