"""GPTQ's column loop over one block in one launch.

  gptq_block(W1, Hi, S, Z, qmin, qmax) -> (codes, errors)      (quant/algorithms.gptq_block_ref)

GPTQ quantizes a block's columns one after the other, each column's error spread over the
columns after it; run as tensor ops that is nine launches per column, and a GPU compile of
SmolLM2-135M spent most of its quant pass there (98,000 columns, ~11 us a launch). Rows are
independent, so each program holds BLOCK_R rows of the block in registers and walks its
columns: the whole block is one launch.

Roundings follow the reference: IEEE division (libdevice's div_rn where compiled; the
interpreter is IEEE anyway), round half to even by the 1.5 * 2**23 trick (exact for |x| < 2**22;
larger quotients are clamped either way), products not contracted into fused multiply-adds
(enable_fp_fusion=False), so each rounding is the reference's.
CPU: the reference; CUDA: Triton.
"""
from __future__ import annotations

import torch

from llmaccel.quant.algorithms import gptq_block_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton
    triton = None

BLOCK_R = 16  # rows per program: 16 x 128 fp32 columns x 3 tiles in registers

if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _gptq_block_kernel(W, H, ST, ZT, Q, E, N, b, s_w, s_h, s_q, qmin, qmax,
                           BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, IEEE: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_B)
        r_ok = rows < N
        c_ok = cols < b
        r64 = rows.to(tl.int64)
        m = r_ok[:, None] & c_ok[None, :]
        w = tl.load(W + r64[:, None] * s_w + cols[None, :], mask=m, other=0.0)
        qs = tl.zeros([BLOCK_R, BLOCK_B], tl.float32)
        es = tl.zeros([BLOCK_R, BLOCK_B], tl.float32)
        for i in range(0, b):
            sel = (cols == i)[None, :]
            wi = tl.sum(tl.where(sel, w, 0.0), 1)               # column i as updated so far
            si = tl.load(ST + i * N + r64, mask=r_ok, other=1.0)
            zi = tl.load(ZT + i * N + r64, mask=r_ok, other=0.0)
            dii = tl.load(H + i * s_h + i)
            if IEEE:
                x = libdevice.div_rn(wi, si)
            else:
                x = wi / si
            q = (x + 12582912.0) - 12582912.0                 # round half to even
            q = tl.minimum(tl.maximum(q + zi, qmin), qmax)
            if IEEE:
                e = libdevice.div_rn(wi - (q - zi) * si, tl.zeros_like(wi) + dii)
            else:
                e = (wi - (q - zi) * si) / dii
            hrow = tl.load(H + i * s_h + cols, mask=c_ok & (cols >= i), other=0.0)
            w = w - e[:, None] * hrow[None, :]
            qs = tl.where(sel, q[:, None], qs)
            es = tl.where(sel, e[:, None], es)
        tl.store(Q + r64[:, None] * s_q + cols[None, :], qs, mask=m)
        tl.store(E + r64[:, None] * s_q + cols[None, :], es, mask=m)

    _INTERPRETED = type(_gptq_block_kernel).__name__ == "InterpretedFunction"


def gptq_block_triton(W1: torch.Tensor, Hi: torch.Tensor, S: torch.Tensor, Z: torch.Tensor,
                      qmin: float, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton form of gptq_block_ref (fp32 inputs; W1 and Hi may be views with row strides)."""
    N, b = W1.shape
    if Hi.shape != (b, b) or S.shape != (N, b) or Z.shape != (N, b):
        raise ValueError(f"gptq_block: W1 {tuple(W1.shape)}, Hi {tuple(Hi.shape)}, S {tuple(S.shape)} "
                         f"and Z {tuple(Z.shape)} disagree")
    W1, Hi = W1.float(), Hi.float()
    if W1.stride(1) != 1:
        W1 = W1.contiguous()
    if Hi.stride(1) != 1:
        Hi = Hi.contiguous()
    ST, ZT = S.float().t().contiguous(), Z.float().t().contiguous()
    Q = torch.empty((N, b), dtype=torch.float32, device=W1.device)
    E = torch.empty_like(Q)
    if N == 0 or b == 0:
        return Q, E
    _gptq_block_kernel[(triton.cdiv(N, BLOCK_R),)](
        W1, Hi, ST, ZT, Q, E, N, b, W1.stride(0), Hi.stride(0), Q.stride(0), float(qmin), float(qmax),
        BLOCK_R=BLOCK_R, BLOCK_B=max(16, triton.next_power_of_2(b)), IEEE=not _INTERPRETED,
        enable_fp_fusion=False)
    return Q, E


def gptq_block(W1, Hi, S, Z, qmin: float, qmax: float):
    """One GPTQ block (gptq_block_ref's contract): one launch on CUDA, the reference elsewhere."""
    if W1.is_cuda and triton is not None:
        return gptq_block_triton(W1, Hi, S, Z, qmin, qmax)
    return gptq_block_ref(W1, Hi, S, Z, qmin, qmax)
