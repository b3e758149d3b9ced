"""gemv_int4 with int8 activations: the decode GEMV over int4 codes in integer dot products.

The fp32 form (gemv_kernels.py) turns every code into an fp32 number and multiplies it by x:
about 11 instructions a weight byte, so it stalls on issue at ~1.5 TB/s (half an H100's copy
bandwidth) however its tiles are shaped. Here x is quantized once per program to int8 codes
with one scale per weight group (amax / 127, as llama.cpp's q8_1 activations of its Q4 GEMV),
and each int32 word of 8 weight codes costs two masks and two dp4a: its even nibbles
(w & 0x0F0F0F0F, byte b = column 8j + 2b) against x's even columns packed four to a word, its
odd nibbles ((w >> 4) & 0x0F0F0F0F) against the odd ones. Per (row, group) the integer sum
becomes  s_g * d_g * (sum q_k c_k - z_g * sum c_k)  (q: weight codes, c: x codes, d_g: x's
scale): exact integers until that product.

Only the activations are approximated, never the weights: x is rounded to 8 bits per group of
128 (a relative error of at most 1/254 of the group's largest value) where bf16 already rounds
it to 8 bits of mantissa. The fused RMSNorm's statistics come from the unrounded x.

Under the Triton interpreter (no inline PTX) dp4a is spelled out on the same packed words.
"""
from __future__ import annotations

import torch

from llmaccel.kernels import cdiv, pdl_enabled, unit_stride
from llmaccel.kernels.int_codes import packed_words
from llmaccel.kernels.quant_linear import split_workspace
from llmaccel.ops.quant import dequantize_int4

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the reference works without triton
    triton = None

# Words per program without split-K (gate and up tiles together with glu) and rows per tile at most.
WORDS, MAX_ROWS = 16384, 64


def quantize_groups(x: torch.Tensor, group_size: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's int8 codes (..., groups, group_size) as fp32 integers and their scales (..., groups):
    round-half-even of x * (127 / amax), K zero-padded to groups * group_size."""
    xf = x.float()
    pad = groups * group_size - xf.shape[-1]
    xg = torch.nn.functional.pad(xf, (0, pad)).reshape(*xf.shape[:-1], groups, group_size)
    amax = xg.abs().amax(-1)
    inv = 127.0 / amax.clamp_min(1e-30)
    codes = torch.round(xg * inv[..., None]).clamp_(-127, 127)
    return codes, amax / 127.0


def gemv_a8_ref(x, qweight, scales, zeros, bias=None, residual=None, *, group_size, eps=None,
                glu=False):
    """The op's values: x rounded to int8 per group, the int4 weights exact, fp32 sums."""
    N, G, _ = qweight.shape
    codes, d = quantize_groups(x, group_size, G)
    w = dequantize_int4(qweight, scales, zeros, group_size, torch.float32)  # (N, G * GS)
    y = torch.einsum("...gk,ngk->...ng", codes, w.reshape(N, G, group_size))
    return finish_ref((y * d[..., None, :]).sum(-1), x, bias, residual, eps, glu)


def finish_ref(y, x, bias, residual, eps, glu):
    """The fused GEMVs' neighbours on fp32 row sums y: the RMSNorm factor of the unrounded x,
    bias, SiLU-mul and residual; rounded once to x's dtype."""
    if eps is not None:
        y = y * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if bias is not None:
        y = y + bias.float()
    if glu:
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


if triton is not None:
    from llmaccel.kernels.gemv_kernels import _gemv_out, _int4_tiles_then_wait, _sumsq8
    from llmaccel.kernels.int_codes import dp4a, x8

    @triton.jit
    def _code(v, inv, IEEE: tl.constexpr):
        """round_half_even(v * inv) as int32 (the product rounded on its own, never fused)."""
        if IEEE:
            p = libdevice.mul_rn(v, inv)
        else:
            p = v * inv
        return ((p + 12582912.0) - 12582912.0).to(tl.int32)

    @triton.jit
    def _pack4(a, b, c, d):
        return (a & 0xFF) | ((b & 0xFF) << 8) | ((c & 0xFF) << 16) | (d << 24)

    @triton.jit
    def _x_codes(x0, x1, x2, x3, x4, x5, x6, x7, IEEE: tl.constexpr):
        """x's codes (groups, GS / 8) packed: even columns 8j, +2, +4, +6 and odd ones, the sum
        of each group's codes and its scale d = amax / 127."""
        amax = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                          tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
        amax = tl.max(amax, 1)
        if IEEE:
            inv = libdevice.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30))
        else:
            inv = 127.0 / tl.maximum(amax, 1e-30)
        iv = inv[:, None]
        c0, c1 = _code(x0, iv, IEEE), _code(x1, iv, IEEE)
        c2, c3 = _code(x2, iv, IEEE), _code(x3, iv, IEEE)
        c4, c5 = _code(x4, iv, IEEE), _code(x5, iv, IEEE)
        c6, c7 = _code(x6, iv, IEEE), _code(x7, iv, IEEE)
        csum = tl.sum(((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)), 1)
        return _pack4(c0, c2, c4, c6), _pack4(c1, c3, c5, c7), csum, amax / 127.0

    @triton.jit
    def _a8_dot(w, s, z, xe, xo, csum, d, ASM: tl.constexpr):
        """Per row: sum over the tile's groups of s * d * (sum q c - z * sum c)."""
        acc = dp4a(w & 0x0F0F0F0F, xe[None], tl.zeros(w.shape, tl.int32), ASM)
        acc = dp4a((w >> 4) & 0x0F0F0F0F, xo[None], acc, ASM)
        dot = tl.sum(acc, 2).to(tl.float32) - z * csum[None, :].to(tl.float32)
        return tl.sum(s * d[None, :] * dot, 1)

    @triton.jit
    def _split_sums(WS, CNT, y, u, rn, n_ok, m, M, slot, ks, NW, N_OUT, SPLIT: tl.constexpr,
                    GLU: tl.constexpr):
        """Split-K in one launch: each program stores its partial sums to WS[ks]; the last of a
        tile's programs to bump its counter (acq_rel, after a barrier orders every thread's
        stores) adds the partials in split order (deterministic), re-zeroes the counter for the
        next call and returns (last, y, u)."""
        base = WS + (ks * M + m).to(tl.int64) * NW
        tl.store(base + rn, y, mask=n_ok)
        if GLU:
            tl.store(base + N_OUT + rn, u, mask=n_ok)
        tl.debug_barrier()
        done = tl.atomic_add(CNT + slot, 1, sem="acq_rel")
        last = done == SPLIT - 1
        y = tl.zeros_like(y)
        u = tl.zeros_like(u)
        if last:
            for k in range(0, SPLIT):
                part = WS + (k * M + m).to(tl.int64) * NW
                y += tl.load(part + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
                if GLU:
                    u += tl.load(part + N_OUT + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(CNT + slot, 0)
        return last, y, u

    @triton.jit
    def _row_rstd(xrow, K, eps, BLOCK: tl.constexpr):
        """rsqrt(mean(x^2) + eps) over the whole row, in chunks of BLOCK."""
        rk = tl.arange(0, BLOCK)
        ss = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            xv = tl.load(xrow + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            ss += xv * xv
        return tl.rsqrt(tl.sum(ss, 0) / K + eps)

    @triton.jit
    def _split_out(WS, CNT, y, u, rn, n_ok, m, M, tile, ks, xrow, K, eps, BIAS, R, O, N_OUT, s_r,
                   s_o, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
                   GLU: tl.constexpr, SPLIT: tl.constexpr):
        """The last of a tile's SPLIT programs sums the partials in order, scales them by the
        row's RMS (NORM: x is re-read, no program saw all of it) and writes the tile."""
        last, y, u = _split_sums(WS, CNT, y, u, rn, n_ok, m, M, m * tl.num_programs(0) // SPLIT
                                 + tile, ks, N_OUT * 2 if GLU else N_OUT, N_OUT, SPLIT, GLU)
        if last:
            if NORM:
                r = _row_rstd(xrow, K, eps, 1024)
                y = y * r
                u = u * r
            _gemv_out(y, u, rn, n_ok, m, BIAS, R, O, N_OUT, s_r, s_o, HAS_BIAS, HAS_RES, GLU)

    @triton.jit
    def _program_tile(N_OUT, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT: tl.constexpr):
        """(x row m, tile, k chunk, the tile's rows, their mask, the chunk's groups) of this
        program: SPLIT programs share a tile of BLOCK_N rows, each over BLOCK_G groups."""
        pid = tl.program_id(0)
        tile = pid // SPLIT
        ks = pid % SPLIT
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        return tl.program_id(1), tile, ks, rn, rn < N_OUT, ks * BLOCK_G + tl.arange(0, BLOCK_G)

    @triton.jit
    def _gemv_a8_kernel(X, W, S, Z, BIAS, R, O, WS, CNT, M, N_OUT, K, G, ZB, s_x, s_r, s_o, eps,
                        GS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                        NORM: tl.constexpr, GLU: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_G: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
                        IEEE: tl.constexpr, ASM: tl.constexpr):
        """Program (tile, ks) owns BLOCK_N rows over groups ks * BLOCK_G ... (SPLIT programs a
        tile): its words, scales and zero points are loaded before the wait for the kernel
        before."""
        m, tile, ks, rn, n_ok, rg = _program_tile(N_OUT, BLOCK_N, BLOCK_G, SPLIT)
        g_ok = rg < G
        w, s, z, wu, su, zu = _int4_tiles_then_wait(W, S, Z, rn, n_ok, rg, g_ok, G, ZB, N_OUT, GS,
                                                     GLU, PDL)
        xrow = X + m.to(tl.int64) * s_x
        x0, x1, x2, x3, x4, x5, x6, x7 = x8(xrow, rg, g_ok, K, GS)
        xe, xo, csum, d = _x_codes(x0, x1, x2, x3, x4, x5, x6, x7, IEEE)
        y = _a8_dot(w, s, z, xe, xo, csum, d, ASM)
        u = y
        if GLU:
            u = _a8_dot(wu, su, zu, xe, xo, csum, d, ASM)
        if SPLIT == 1:
            if NORM:
                r = tl.rsqrt(_sumsq8(x0, x1, x2, x3, x4, x5, x6, x7) / K + eps)
                y = y * r
                u = u * r
            _gemv_out(y, u, rn, n_ok, m, BIAS, R, O, N_OUT, s_r, s_o, HAS_BIAS, HAS_RES, GLU)
        else:
            _split_out(WS, CNT, y, u, rn, n_ok, m, M, tile, ks, xrow, K, eps, BIAS, R, O, N_OUT,
                       s_r, s_o, HAS_BIAS, HAS_RES, NORM, GLU, SPLIT)


def gemv_a8_config(n_out: int, groups: int, group_size: int, glu: bool, words: int | None = None,
                   warps: int | None = None, split: int | None = None,
                   codes_per_word: int = 8) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_G, warps, programs per tile): groups in `split` chunks of a power of two
    (fewer where that covers them), about `words` words a program. By default (one H100,
    docs/results/h100-2026-12-08-gemv-a8-sweep.json): K up to 2,048 in one chunk and tiles of up
    to 16K words x 8 warps; longer K in 4 chunks and tiles of up to 8K words x 4 warps (at 16K x
    8 warps llama2-7b's split gate_up ran 4x slower); at most 64 rows a tile."""
    if split is None:
        split = 1 if groups * group_size <= 2048 else 4
    block_g = triton.next_power_of_2(cdiv(groups, split))
    per_row = block_g * (group_size // codes_per_word) * (2 if glu else 1)
    cap = words or (WORDS if split == 1 else WORDS // 2)
    block_n = 1 << (max(1, min(cap // per_row, MAX_ROWS, n_out)).bit_length() - 1)
    warps = warps or (8 if block_n * per_row >= WORDS else 4)
    return block_n, block_g, warps, cdiv(groups, block_g)


def split_buffers(x, out, M: int, N: int, split: int, cfg: tuple, unsplit) -> tuple:
    """(partials, counters, split, *cfg) of a launch with `split` programs a tile (`out` stands
    in for the buffers unsplit); while a graph is captured before the buffers exist, the launch
    runs unsplit with unsplit()'s (BLOCK_N, BLOCK_G, warps)."""
    if split == 1:
        return (out, out, 1, *cfg)
    tiles = cdiv(N, cfg[0]) * M  # counters: at least one per (row tile, token)
    buffers = split_workspace(x.device, split * M * N, tiles)
    if buffers is None:
        return (out, out, 1, *unsplit())
    return (*buffers, split, *cfg)


def gemv_a8_triton(x, qweight, scales, zeros, bias=None, residual=None, *, group_size, eps=None,
                   glu=False, num_warps=None, words=None, split=None, pdl=None, interpreted=None):
    """gemv_a8_ref's values from the kernel (x: (..., K), unit column stride)."""
    N, G, _ = qweight.shape
    n_out = N // 2 if glu else N
    K = x.shape[-1]
    x2 = unit_stride(x.reshape(-1, K))
    M = x2.shape[0]
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    r = unit_stride(residual.reshape(M, n_out)) if residual is not None else None
    w = packed_words(qweight)
    s, z = scales.contiguous(), zeros.contiguous()
    bn, bg, num_warps, split = gemv_a8_config(n_out, G, group_size, glu, words, num_warps, split)
    ws, cnt, split, bn, bg, num_warps = split_buffers(
        x, out, M, N, split, (bn, bg, num_warps),
        lambda: gemv_a8_config(n_out, G, group_size, glu, words, num_warps, 1)[:3])
    tiles = cdiv(n_out, bn)
    if pdl is None:
        pdl = pdl_enabled(x)
    if interpreted is None:
        interpreted = not x.is_cuda
    extra = {"launch_pdl": True} if pdl else {}
    _gemv_a8_kernel[(tiles * split, M)](
        x2, w, s, z, bias if bias is not None else out, r if r is not None else out, out, ws, cnt,
        M, n_out, K, G, zeros.shape[1], x2.stride(0), r.stride(0) if r is not None else 0,
        out.stride(0), float(eps) if eps is not None else 0.0, GS=group_size,
        HAS_BIAS=bias is not None, HAS_RES=r is not None, NORM=eps is not None, GLU=glu,
        BLOCK_N=bn, BLOCK_G=bg, SPLIT=split, PDL=pdl, IEEE=not interpreted, ASM=not interpreted,
        num_warps=num_warps, **extra)
    return out.reshape(*x.shape[:-1], n_out)
