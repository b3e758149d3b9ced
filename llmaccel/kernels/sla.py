"""SLA prefill: the chunked causal form of normalized ReLU linear attention + depthwise conv on V.

Reference: llmaccel.ops.sla (the IR op `linear_attention` with ctx None, i.e. `sla_forward`).

Grid: (batch * n_heads, head_dim / BLOCK_DV). A program owns one query head of one sequence and
a slice of the value dimension, and walks the sequence in chunks of C tokens carrying the state
S = sum phi(k)^T v (head_dim x BLOCK_DV, fp32) and z = sum phi(k) (head_dim, fp32) in registers:

    A   = mask_causal(phi(q_c) phi(k_c)^T)                         (C x C, fp32)
    out = (A v_c + phi(q_c) S) / (rowsum(A) + phi(q_c) . z + eps) + sum_j w_j * v[t - K + 1 + j]
    S  += phi(k_c)^T v_c,  z += colsum(phi(k_c))

so the work is O(T * C * D) per head, linear in T. Splitting the value dimension multiplies the
programs (a short batch has few heads to spread over the SMs); the denominator needs all of
head_dim of q and z only, so each slice computes it alone. Query heads of one KV head recompute
the same k^T v update (GQA): cheap next to the intra-chunk products and it keeps programs
independent. q phi(k)^T runs on the input dtype with fp32 accumulation; products with the fp32
state run in fp32 (tf32 on the GPU for half inputs, IEEE for fp32 inputs): S grows with the
length and would overflow fp16.

Custom op llmaccel::linear_attention(q, k, v, conv_weight, *, n_heads, n_kv_heads, head_dim,
kernel_size, eps): CPU = the reference, CUDA = the Triton wrapper. The IR node also takes the
attention context and the layer, so the lowering keeps it on the reference path (which owns the
recurrent state for decode); the custom op serves whole-sequence prefill.
"""
from __future__ import annotations

import torch

from llmaccel.kernels import cdiv
from llmaccel.ops.sla import sla_forward

try:  # kernels are optional: every non-CUDA path works without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is absent
    triton = None
    tl = None

HAS_TRITON = triton is not None
CHUNK = 64
BLOCK_DV = 32


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


if HAS_TRITON:
    @triton.jit
    def _linear_attention_kernel(q_ptr, k_ptr, v_ptr, w_ptr, o_ptr, T, H, G, D, W_DIV,
                                 sq_b, sq_t, sk_b, sk_t, so_b, so_t, eps,
                                 KS: tl.constexpr, C: tl.constexpr, BD: tl.constexpr,
                                 BDV: tl.constexpr, IEEE: tl.constexpr):
        pid, pe = tl.program_id(0), tl.program_id(1)
        b, h = pid // H, pid % H
        j = h // G
        d = tl.arange(0, BD)
        e = pe * BDV + tl.arange(0, BDV)
        dm, em = d < D, e < D
        # conv weight row of this channel: per query head (H*D rows, W_DIV 1) or per KV head
        # (Hkv*D rows, W_DIV G)
        wrow = (h // W_DIV) * D + e
        q_base = q_ptr + b * sq_b + h * D
        k_base = k_ptr + b * sk_b + j * D
        v_base = v_ptr + b * sk_b + j * D
        S = tl.zeros((BD, BDV), dtype=tl.float32)
        z = tl.zeros((BD,), dtype=tl.float32)
        r = tl.arange(0, C)
        for c0 in range(0, T, C):
            t = c0 + r
            tm = t < T
            q = tl.load(q_base + t[:, None] * sq_t + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
            k = tl.load(k_base + t[:, None] * sk_t + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
            v = tl.load(v_base + t[:, None] * sk_t + e[None, :], mask=tm[:, None] & em[None, :], other=0.0)
            q = tl.maximum(q, 0.0)
            k = tl.maximum(k, 0.0)
            qf, vf = q.to(tl.float32), v.to(tl.float32)
            if IEEE:
                A = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                A = tl.dot(q, tl.trans(k))
            A = tl.where(r[:, None] >= r[None, :], A, 0.0)
            if IEEE:
                num = tl.dot(A, vf, input_precision="ieee") + tl.dot(qf, S, input_precision="ieee")
            else:
                num = tl.dot(A, vf, input_precision="tf32") + tl.dot(qf, S, input_precision="tf32")
            den = tl.sum(A, axis=1) + tl.sum(qf * z[None, :], axis=1)
            out = num / (den[:, None] + eps)
            for i in tl.static_range(KS):
                ts = t - (KS - 1) + i
                vs = tl.load(v_base + ts[:, None] * sk_t + e[None, :],
                             mask=((ts >= 0) & (ts < T))[:, None] & em[None, :], other=0.0)
                wi = tl.load(w_ptr + wrow * KS + i, mask=em, other=0.0)
                out += vs.to(tl.float32) * wi.to(tl.float32)[None, :]
            tl.store(o_ptr + b * so_b + t[:, None] * so_t + h * D + e[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=tm[:, None] & em[None, :])
            # the ReLU may have promoted k to fp32 while v is still 16-bit: update S in fp32
            kf = k.to(tl.float32)
            if IEEE:
                S += tl.dot(tl.trans(kf), vf, input_precision="ieee")
            else:
                S += tl.dot(tl.trans(kf), vf, input_precision="tf32")
            z += tl.sum(k.to(tl.float32), axis=0)


def linear_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            conv_weight: torch.Tensor, *, n_heads: int, n_kv_heads: int,
                            head_dim: int, kernel_size: int, eps: float, chunk: int = CHUNK,
                            block_dv: int = BLOCK_DV) -> torch.Tensor:
    """Whole-sequence SLA: q (B, T, H*D), k and v (B, T, Hkv*D), conv_weight (H*D or Hkv*D, K)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, T, _ = q.shape
    H, Hkv, D, K = n_heads, n_kv_heads, head_dim, kernel_size
    if H % Hkv:
        raise ValueError(f"linear_attention: n_heads {H} is not a multiple of n_kv_heads {Hkv}")
    if q.shape[-1] != H * D or k.shape != (B, T, Hkv * D) or v.shape != k.shape:
        raise ValueError(f"linear_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"do not match {H} heads, {Hkv} KV heads of {D}")
    if conv_weight.shape[1] != K or conv_weight.shape[0] not in (H * D, Hkv * D):
        raise ValueError(f"linear_attention: conv_weight is {tuple(conv_weight.shape)}; expected "
                         f"({H * D} or {Hkv * D}, {K})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"linear_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    q, k, v, w = q.contiguous(), k.contiguous(), v.contiguous(), conv_weight.contiguous()
    out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    BD = _pow2(D)
    BDV = min(BD, _pow2(block_dv))
    grid = (B * H, cdiv(D, BDV))
    _linear_attention_kernel[grid](q, k, v, w, out, T, H, H // Hkv, D, 1 if w.shape[0] == H * D else H // Hkv,
                                   q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                   out.stride(0), out.stride(1), float(eps),
                                   KS=K, C=_pow2(chunk), BD=BD, BDV=BDV,
                                   IEEE=q.dtype == torch.float32)
    return out


@torch.library.custom_op("llmaccel::linear_attention", mutates_args=())
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, conv_weight: torch.Tensor, *,
                     n_heads: int, n_kv_heads: int, head_dim: int, kernel_size: int,
                     eps: float) -> torch.Tensor:
    return sla_forward(q, k, v, conv_weight, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim, kernel_size=kernel_size, eps=eps)[0]


@linear_attention.register_kernel("cuda")
def _linear_attention_cuda(q, k, v, conv_weight, *, n_heads, n_kv_heads, head_dim, kernel_size, eps):
    kw = dict(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, kernel_size=kernel_size, eps=eps)
    if triton is None:
        return sla_forward(q, k, v, conv_weight, **kw)[0]
    return linear_attention_triton(q, k, v, conv_weight, **kw)


@linear_attention.register_fake
def _linear_attention_fake(q, k, v, conv_weight, *, n_heads, n_kv_heads, head_dim, kernel_size, eps):
    return q.new_empty(q.shape)
