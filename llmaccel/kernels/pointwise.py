"""RoPE on tables and SiLU-mul, one launch each, for the engine's uncompiled steps.

The prefill and mixed steps run the lowered graph eagerly (their token counts change every
step): there RoPE's rotate-half on tables is about eight aten kernels per rotation (two gathers
and casts, a negation, a cat, two multiplies, an add) and SiLU-mul two. On the H200 an
8,192-token prefill step of llama-1b spent ~4.5 of its 31.7 GPU ms in the rotations and 2.6 in
SiLU-mul; each kernel here reads its inputs once and writes its output once.

Roundings follow the references: ops.rope.rope_table multiplies and adds in x's dtype (each
product rounded, then the sum), ops.silu_mul rounds SiLU to the dtype before the multiply.
Products are not contracted into fused multiply-adds (enable_fp_fusion=False).

Custom ops llmaccel::rope_table and llmaccel::silu_mul: CPU = the references, CUDA = Triton.
Only the eager steps map to them (lower(select="eager")): compiled steps keep the references,
which Inductor fuses with their neighbours and the decode steps' RoPE attention folds in.
"""
from __future__ import annotations

import torch

from llmaccel import ops
from llmaccel.ops.rope import rope_table as rope_ref
from llmaccel.kernels import registered, rows_2d, unit_stride

try:  # kernels are optional: every non-CUDA path works without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is absent
    triton = None
    tl = None

ROWS = 4  # token rows a program rotates / activates (fewer programs at thousands of tokens)

if triton is not None:
    @triton.jit
    def _rope_kernel(X, C, S, P, O, N, T, sxb, sxt, spb, spt, H: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
        pid = tl.program_id(0)
        hs = tl.arange(0, BLOCK_H)[:, None]
        ds = tl.arange(0, BLOCK_D)[None, :]
        ok = (hs < H) & (ds < HALF)
        for i in range(ROWS):
            r = pid * ROWS + i
            if r < N:
                b = r // T
                t = r - b * T
                pos = tl.load(P + b * spb + t * spt).to(tl.int64)
                c1 = tl.load(C + pos * (2 * HALF) + ds, mask=ds < HALF, other=0.0).to(X.dtype.element_ty)
                c2 = tl.load(C + pos * (2 * HALF) + HALF + ds, mask=ds < HALF, other=0.0).to(X.dtype.element_ty)
                s1 = tl.load(S + pos * (2 * HALF) + ds, mask=ds < HALF, other=0.0).to(X.dtype.element_ty)
                s2 = tl.load(S + pos * (2 * HALF) + HALF + ds, mask=ds < HALF, other=0.0).to(X.dtype.element_ty)
                base = X + b.to(tl.int64) * sxb + t.to(tl.int64) * sxt + hs * (2 * HALF) + ds
                x1 = tl.load(base, mask=ok, other=0.0)
                x2 = tl.load(base + HALF, mask=ok, other=0.0)
                dt = x1.dtype
                # rot = cat(-x2, x1): out1 = x1*c1 + (-x2)*s1, out2 = x2*c2 + x1*s2, each product
                # and the sum rounded to x's dtype as the reference's tensor ops round them
                o1 = ((x1.to(tl.float32) * c1.to(tl.float32)).to(dt).to(tl.float32)
                      + (-x2.to(tl.float32) * s1.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
                o2 = ((x2.to(tl.float32) * c2.to(tl.float32)).to(dt).to(tl.float32)
                      + (x1.to(tl.float32) * s2.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
                out = O + r.to(tl.int64) * (H * 2 * HALF) + hs * (2 * HALF) + ds
                tl.store(out, o1, mask=ok)
                tl.store(out + HALF, o2, mask=ok)

    @triton.jit
    def _silu_mul_kernel(G, U, O, N, I, sg, su, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        for i in range(ROWS):
            r = pid * ROWS + i
            if r < N:
                g = tl.load(G + r.to(tl.int64) * sg + cols, mask=ok, other=0.0)
                u = tl.load(U + r.to(tl.int64) * su + cols, mask=ok, other=0.0)
                gf = g.to(tl.float32)
                # F.silu in float, x / (1 + exp(-x)) as torch's kernel (its exp may differ by an ulp)
                s = tl.div_rn(gf, 1.0 + tl.exp(-gf)).to(g.dtype)
                o = (s.to(tl.float32) * u.to(tl.float32)).to(O.dtype.element_ty)
                tl.store(O + r.to(tl.int64) * I + cols, o, mask=ok)


def rope_table_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      head_dim: int) -> torch.Tensor:
    """ops.rope.rope_table on CUDA: x (B, T, H * head_dim) with unit stride in its last dim
    (a view of a fused projection is read in place), positions (B, T), cos / sin (rows, head_dim)."""
    B, T, HD = x.shape
    if HD % head_dim or head_dim % 2:
        raise ValueError(f"rope_table: rows of {HD} are not whole heads of an even {head_dim}")
    x = unit_stride(x)
    cos, sin = cos.contiguous(), sin.contiguous()
    H, half = HD // head_dim, head_dim // 2
    out = torch.empty((B, T, HD), dtype=x.dtype, device=x.device)
    N = B * T
    if N:
        pos = positions.expand(B, T)
        _rope_kernel[(triton.cdiv(N, ROWS),)](
            x, cos, sin, pos, out, N, T, x.stride(0), x.stride(1), pos.stride(0), pos.stride(1),
            H=H, HALF=half, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(half),
            ROWS=ROWS, num_warps=4, enable_fp_fusion=False)
    return out


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """ops.silu_mul on CUDA for gate and up of one shape, each with evenly strided rows and unit
    stride in the last dim (the two halves of a fused gate/up projection are read in place)."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    I = gate.shape[-1]
    g2, u2 = rows_2d(gate), rows_2d(up)
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    out = torch.empty(gate.shape, dtype=out_dtype, device=gate.device)
    N = g2.shape[0]
    if N and I:
        BLOCK = min(2048, triton.next_power_of_2(I))
        _silu_mul_kernel[(triton.cdiv(N, ROWS), triton.cdiv(I, BLOCK))](
            g2, u2, out, N, I, g2.stride(0), u2.stride(0), BLOCK=BLOCK, ROWS=ROWS,
            num_warps=8 if BLOCK >= 2048 else 4, enable_fp_fusion=False)
    return out


if not registered("rope_table"):
    @torch.library.custom_op("llmaccel::rope_table", mutates_args=())
    def rope_table(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, *,
                   head_dim: int) -> torch.Tensor:
        return rope_ref(x, cos, sin, positions, head_dim=head_dim)  # a new tensor, never x

    @rope_table.register_fake
    def _(x, cos, sin, positions, *, head_dim):
        return x.new_empty(x.shape)

    @torch.library.custom_op("llmaccel::silu_mul", mutates_args=())
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(gate, up)  # a new tensor

    @silu_mul.register_fake
    def _(gate, up):
        return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))

    if triton is not None:
        @rope_table.register_kernel("cuda")
        def _(x, cos, sin, positions, *, head_dim):
            return rope_table_triton(x, cos, sin, positions, head_dim)

        @silu_mul.register_kernel("cuda")
        def _(gate, up):
            return silu_mul_triton(gate, up)

# On the CPU the lowering keeps the references themselves (a Python custom op costs ~80 us a call).
CPU_FORMS = {"silu_mul": (None, ops.silu_mul)}
