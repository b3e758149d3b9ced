"""Building blocks of the integer-weight kernels (quant_linear.py, quant_linear_int8.py,
gemv.py): codes turned into exact fp32 integers without int-to-float conversions (those issue at
1/8 of the FMA rate on Hopper), tiles of the MatMulNBits int4 layout, the output epilogues, and
the host-side buffers they share.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference paths work without triton
    triton = None


if triton is not None:
    @triton.jit
    def nib(w, MASK: tl.constexpr, INV: tl.constexpr, z):
        """The 4-bit field MASK of each word minus z (0.0, or the zero point broadcast to w) as an
        exact fp32 integer (MASK below bit 20)."""
        v = ((w & MASK) | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + field, exactly
        return tl.fma(v, INV, -8388608.0 * INV - z)  # exact: one rounding of an exact integer

    @triton.jit
    def byte(w, MASK: tl.constexpr, FLIP: tl.constexpr, INV: tl.constexpr):
        """The signed int8 field MASK of each word as an exact fp32 integer: the XOR flips the
        sign bit (q + 128 >= 0) and sets the magic exponent in one op."""
        v = ((w & MASK) ^ FLIP).to(tl.float32, bitcast=True)
        return tl.fma(v, INV, -(8388608.0 * INV + 128.0))

    @triton.jit
    def dp4a(c, xw, acc, ASM: tl.constexpr, SIGNED: tl.constexpr = False):
        """acc + sum over the four bytes of c (unsigned; signed with SIGNED) x the bytes of xw
        (signed); ASM=False (the interpreter has no inline PTX) spells it out on the same words."""
        if ASM:
            if SIGNED:
                return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                                 [c, xw, acc], dtype=tl.int32, is_pure=True, pack=1)
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                             [c, xw, acc], dtype=tl.int32, is_pure=True, pack=1)
        if SIGNED:
            return acc + ((c << 24) >> 24) * ((xw << 24) >> 24) + ((c << 16) >> 24) * ((xw << 16) >> 24) \
                + ((c << 8) >> 24) * ((xw << 8) >> 24) + (c >> 24) * (xw >> 24)
        return acc + (c & 0xFF) * ((xw << 24) >> 24) + ((c >> 8) & 0xFF) * ((xw << 16) >> 24) \
            + ((c >> 16) & 0xFF) * ((xw << 8) >> 24) + ((c >> 24) & 0xFF) * (xw >> 24)

    @triton.jit
    def int4_words(w, z):
        """The 8 codes of each int32 word (column 8j + i in nibble i) minus z, as fp32 (exact:
        2^23 * 16^-i + z is an fp32 integer, so the FMA's addend is exact too)."""
        wh = w >> 12  # nibbles 5..7 would reach the exponent bits in place
        n0 = nib(w, 0xF, 1.0, z)
        n1 = nib(w, 0xF0, 0.0625, z)
        n2 = nib(w, 0xF00, 0.00390625, z)
        n3 = nib(w, 0xF000, 0.000244140625, z)
        n4 = nib(w, 0xF0000, 0.0000152587890625, z)
        n5 = nib(wh, 0xF00, 0.00390625, z)
        n6 = nib(wh, 0xF000, 0.000244140625, z)
        n7 = nib(wh, 0xF0000, 0.0000152587890625, z)
        return n0, n1, n2, n3, n4, n5, n6, n7

    @triton.jit
    def interleave8(n0, n1, n2, n3, n4, n5, n6, n7):
        """(..., W) x 8 -> (..., W, 2, 2, 2) with element [c, b, a] = n[4c + 2b + a]: flattening
        the last three dims puts the 8 codes of a word in column order."""
        return tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)),
                       tl.join(tl.join(n1, n5), tl.join(n3, n7)))

    @triton.jit
    def int4_tile(W, S, Z, rows, n_ok, g, g_ok, G, ZB, GS: tl.constexpr):
        """Words (rows, groups, GS / 8), scales and zero points (rows, groups) of a tile of the
        MatMulNBits layout (rows in the index type the caller's sizes need)."""
        rw = tl.arange(0, GS // 8)
        nm = n_ok[:, None] & g_ok[None, :]
        w = tl.load(W + rows[:, None, None] * (G * (GS // 8)) + g[None, :, None] * (GS // 8)
                    + rw[None, None, :], mask=nm[:, :, None], other=0)
        s = tl.load(S + rows[:, None] * G + g[None, :], mask=nm, other=0.0).to(tl.float32)
        zb = tl.load(Z + rows[:, None] * ZB + (g // 2)[None, :], mask=nm, other=0).to(tl.int32)
        z = ((zb >> ((g % 2) * 4)[None, :]) & 0xF).to(tl.float32)
        return w, s, z

    @triton.jit
    def x8(xrow, g, g_ok, K, GS: tl.constexpr):
        """x's columns of a tile's groups split by nibble: x_i holds column 8j + i (next to
        nibble i of word j), (groups, GS / 8), fp32, zero past K."""
        xk = g[:, None] * GS + 8 * tl.arange(0, GS // 8)[None, :]
        xm = g_ok[:, None]
        x0 = tl.load(xrow + xk, mask=xm & (xk < K), other=0.0).to(tl.float32)
        x1 = tl.load(xrow + xk + 1, mask=xm & (xk + 1 < K), other=0.0).to(tl.float32)
        x2 = tl.load(xrow + xk + 2, mask=xm & (xk + 2 < K), other=0.0).to(tl.float32)
        x3 = tl.load(xrow + xk + 3, mask=xm & (xk + 3 < K), other=0.0).to(tl.float32)
        x4 = tl.load(xrow + xk + 4, mask=xm & (xk + 4 < K), other=0.0).to(tl.float32)
        x5 = tl.load(xrow + xk + 5, mask=xm & (xk + 5 < K), other=0.0).to(tl.float32)
        x6 = tl.load(xrow + xk + 6, mask=xm & (xk + 6 < K), other=0.0).to(tl.float32)
        x7 = tl.load(xrow + xk + 7, mask=xm & (xk + 7 < K), other=0.0).to(tl.float32)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def epilogue_serial(acc, ws_ptr, cnt_ptr, b_ptr, out_ptr, rm, rn, M, N, tile, pid_k, n_split,
                         HAS_BIAS: tl.constexpr):
        """Split-K in one launch (no memset, no cast kernel): every program stores its fp32
        partial to ws[pid_k]; the last of a tile's programs to bump the tile's counter sums the
        partials, adds the bias, writes x's dtype and re-zeroes the counter for the next call.
        The barrier + acq_rel atomic order all threads' partial stores before the count and the
        final loads (L2 only: .cg) after it."""
        om = (rm < M)[:, None] & (rn < N)[None, :]
        off = rm[:, None] * N + rn[None, :]
        tl.store(ws_ptr + pid_k * M * N + off, acc, mask=om)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == n_split - 1:
            tot = tl.zeros_like(acc)
            for k in range(0, n_split):
                tot += tl.load(ws_ptr + k * M * N + off, mask=om, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + off, tot.to(out_ptr.dtype.element_ty), mask=om)
            tl.atomic_xchg(cnt_ptr + tile, 0)

    @triton.jit
    def epilogue(acc, b_ptr, out_ptr, rm, rn, M, N, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr):
        n_ok = rn < N
        o = out_ptr + rm[:, None] * N + rn[None, :]
        om = (rm < M)[:, None] & n_ok[None, :]
        if ATOMIC:  # fp32 partials; the wrapper adds the bias and casts
            tl.atomic_add(o, acc, mask=om)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=om)


def rows_of(x: torch.Tensor, K: int) -> torch.Tensor:
    x2 = x.reshape(-1, K)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def out_buffer(M, N, x, split):
    if split > 1:  # atomics need a zeroed fp32 buffer
        return torch.zeros(M, N, device=x.device, dtype=torch.float32)
    return torch.empty(M, N, device=x.device, dtype=x.dtype)


def finish(out, x, bias, split):
    if split > 1:
        out = out.to(x.dtype)
        if bias is not None:
            out += bias.to(x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def packed_words(q: torch.Tensor) -> torch.Tensor:
    """The codes as int32 words (N, bytes / 4), a view of the same storage."""
    w = q.reshape(q.shape[0], -1)
    if not w.is_contiguous() or w.data_ptr() % 16:  # a fresh copy is aligned (slow path)
        w = w.clone(memory_format=torch.contiguous_format)
    return w.view(torch.int32)


def cpu_act_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype aten's CPU weight-only GEMMs (int4 and int8) run in for x of `dtype`:
    bf16 for fp32. Their fp32 paths are scalar loops: on a 2-core AVX-512 CPU at one row, 576 x
    1536 int4 took 809 us in fp32 against 45 us in bf16 (fp32 F.linear: 81 us), int8 493 against
    36 us. The products are still summed in fp32; x rounded to bf16 (8 bits of mantissa) costs far
    less than the weights' 4 or 8 bits (docs/performance.md, CPU)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


def cpu_bf16_dots() -> bool:
    """Whether fp32 graphs' linears run in bf16 on this CPU: where it multiplies bf16 in hardware
    (AVX512-BF16 or AMX, as torch reports it), unless LLMACCEL_CPU_BF16=0 asks for fp32 ones."""
    if os.environ.get("LLMACCEL_CPU_BF16", "1") == "0":
        return False
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def prepare_bf16_cpu(weight):
    """(the weight in bf16,) for linear_bf16_cpu where the CPU has bf16 dot products and the
    weight is fp32; None (the fp32 linear) elsewhere."""
    return (weight.to(torch.bfloat16),) if weight.dtype == torch.float32 and cpu_bf16_dots() else None


def linear_bf16_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear of an fp32 graph with bf16 weights and x, fp32 sums and output: on 2 AVX512-BF16
    cores at one row the real SmolLM2-135M's decode step takes ~0.6x the fp32 one's time
    (docs/performance.md, CPU); the norms, residuals and attention stay in fp32."""
    b = None if bias is None else bias.to(weight.dtype)
    return torch.nn.functional.linear(x.to(weight.dtype), weight, b).to(x.dtype)


def int8_codes_cpu(codes: torch.Tensor, scale: torch.Tensor) -> tuple:
    """(codes as a (K, N) view, their column sums, fp32 scales) for int8_mm_cpu, from int8
    codes (N, K) with one scale per row."""
    return codes.t(), codes.sum(1, dtype=torch.int32).float(), scale.float()


def int8_mm_cpu(x: torch.Tensor, codes_t: torch.Tensor, csum: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (codes_t * scale) + bias on the CPU by one int8 x int8 GEMM (torch._int_mm, oneDNN's
    VNNI kernels, int32 sums). x is rounded to 16 bits per row (absmax / 32767) and split into
    two int8 halves, hi and lo - 128, stacked as 2M rows so the codes are read once:
    sum(x16 w) = 256 sum(hi w) + sum((lo - 128) w) + 128 sum(w). One int8 half alone (Q8_0's
    rounding, per row) cost +2.6-4.0% ppl on W8; 16 bits is finer than bf16 x. From memory on 2
    AVX-512 cores, SmolLM2's 30 layers of int8 linears at one row: 3.3 ms against 8.8 for aten's
    weight-only int8 GEMM with x in bf16 (docs/performance.md, CPU). codes_t, csum, scale: from
    int8_codes_cpu, converted once at lowering."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    s = x2.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 32767
    q = torch.round(x2 / s).to(torch.int32)
    hi = torch.div(q, 256, rounding_mode="floor")
    halves = torch.cat([hi, q - 256 * hi - 128]).to(torch.int8)
    acc = torch._int_mm(halves, codes_t).float()
    m = x2.shape[0]
    out = (acc[:m] * 256 + acc[m:] + csum * 128) * (s * scale)
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*shape[:-1], codes_t.shape[1]).to(x.dtype)


def w8a8_mm_cpu(x: torch.Tensor, codes_t: torch.Tensor, smooth: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """ops.quant.linear_w8a8 on the CPU: x * smooth rounded to int8 per row, one int8 x int8 GEMM
    (torch._int_mm at M = the rows: oneDNN's one-row kernel reads the codes at ~2.7x the rate
    of aten's weight-only GEMM), int32 sums scaled once per row and output. codes_t: the (N, K)
    codes as a (K, N) view; smooth, scale fp32 (prepare_w8a8_cpu)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float() * smooth
    s = x2.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    out = torch._int_mm(torch.round(x2 / s).to(torch.int8), codes_t).float() * (s * scale)
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*shape[:-1], codes_t.shape[1]).to(x.dtype)


def prepare_head_cpu(weight):
    """int8_codes_cpu's tensors for the LM head, converted once at lowering: symmetric codes, one
    scale per vocabulary row (absmax / 127; llama.cpp's Q4 files keep the head in Q8_0 too).
    SmolLM2's 49,152 x 576 head on 2 AVX-512 cores at one row: fp32 10.2 ms, bf16 4.4-5.1, int8
    codes with x in bf16 2.2 (docs/performance.md, CPU): the largest single read of a W4 step."""
    w = weight.float()
    scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return int8_codes_cpu(torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale)
