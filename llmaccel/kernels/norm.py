"""RMSNorm, with or without the residual add before it, one program per row.

The engine's prefill and mixed steps run the lowered graph eagerly (their token counts change
every step, so they are neither compiled nor captured): there the reference RMSNorm is seven
aten kernels (cast, square, mean, rsqrt, two multiplies, cast back) and, with the add, eight.
On the H200 an 8,192-token prefill step of llama-1b spent ~7 of its 38 GPU ms in them; this
kernel reads each row once and writes it once.

Roundings follow the reference (llmaccel.ops.rms_norm): normalise in fp32, round to x's dtype,
then multiply by the weight in the result dtype; the residual sum is rounded to its dtype first.

Custom ops llmaccel::rms_norm and llmaccel::add_rms_norm: CPU = the reference, CUDA = Triton.
Only the eager steps map to them (codegen.lower's select="eager"): in compiled steps Inductor
fuses the norm with its neighbours, and the GEMV rewrites read the IR's norm nodes.
"""
from __future__ import annotations

from typing import Optional

import torch

from llmaccel import ops
from llmaccel.kernels import registered, rows_2d

try:  # kernels are optional: every non-CUDA path works without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is absent
    triton = None
    tl = None

if triton is not None:
    @triton.jit
    def _rms_norm_kernel(X, R, W, O, S, D, eps, sx, sr, so, ss,
                         HAS_RES: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < D
        x = tl.load(X + row * sx + offs, mask=ok, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(R + row * sr + offs, mask=ok, other=0.0).to(tl.float32))
            x = x.to(S.dtype.element_ty)  # the sum in its dtype, as the reference rounds it
            tl.store(S + row * ss + offs, x, mask=ok)
        h = x.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(h * h, 0) / D + eps)
        h = (h * r).to(x.dtype).to(tl.float32)
        if HAS_W:
            h = h * tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(O + row * so + offs, h.to(O.dtype.element_ty), mask=ok)


def _dtypes(x, residual, weight) -> tuple[torch.dtype, torch.dtype]:
    """(the residual sum's dtype, the output's), as the reference's type promotion gives them."""
    s = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return s, (s if weight is None else torch.promote_types(weight.dtype, s))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    residual: torch.Tensor | None = None):
    """rms_norm(x) (weight may be None), or with residual: (rms_norm(x + residual), x + residual)."""
    D = x.shape[-1]
    if weight is not None and weight.shape != (D,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not fit rows of {D}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    s_dtype, out_dtype = _dtypes(x, residual, weight)
    x2 = rows_2d(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    s = torch.empty(x.shape, dtype=s_dtype, device=x.device) if residual is not None else out
    r2 = rows_2d(residual) if residual is not None else x2
    n = x2.shape[0]
    if n:
        BLOCK = max(16, triton.next_power_of_2(D))
        _rms_norm_kernel[(n,)](
            x2, r2, weight if weight is not None else x2, out, s, D, eps,
            x2.stride(0), r2.stride(0), D, D,
            HAS_RES=residual is not None, HAS_W=weight is not None, BLOCK=BLOCK,
            num_warps=8 if BLOCK >= 4096 else 4 if BLOCK >= 1024 else 1)
    return out if residual is None else (out, s)


if not registered("rms_norm"):
    @torch.library.custom_op("llmaccel::rms_norm", mutates_args=())
    def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], *, eps: float) -> torch.Tensor:
        return ops.rms_norm(x, weight, eps=eps)  # a new tensor: x * rsqrt(...) never aliases x

    @rms_norm.register_fake
    def _(x, weight, *, eps):
        return x.new_empty(x.shape, dtype=_dtypes(x, None, weight)[1])

    @torch.library.custom_op("llmaccel::add_rms_norm", mutates_args=())
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], *,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.add_rms_norm(x, residual, weight, eps=eps)  # both new tensors

    @add_rms_norm.register_fake
    def _(x, residual, weight, *, eps):
        sd, dt = _dtypes(x, residual, weight)
        return x.new_empty(x.shape, dtype=dt), x.new_empty(x.shape, dtype=sd)

    if triton is not None:
        @rms_norm.register_kernel("cuda")
        def _(x, weight, *, eps):
            return rms_norm_triton(x, weight, eps)

        @add_rms_norm.register_kernel("cuda")
        def _(x, residual, weight, *, eps):
            return rms_norm_triton(x, weight, eps, residual)

# On the CPU the lowering keeps the reference itself (a Python custom op costs ~80 us a call).
CPU_FORMS = {"rms_norm": (None, ops.rms_norm), "add_rms_norm": (None, ops.add_rms_norm)}
