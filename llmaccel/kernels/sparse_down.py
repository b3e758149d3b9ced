"""Sparse down-projection: out = x @ weight_t (+ bias), skipping the weight rows of zero inputs.

After ReLUfication most MLP activations are exact zeros. weight_t is (K, N) = (intermediate,
hidden), so one activation channel owns one contiguous row. The kernel loads each row under a
mask that is true only if some token of the block has a non-zero activation in that channel: a
masked-off row costs no memory traffic, and at decode (memory-bound) the time falls with the
density of the activations. Blocks of tokens share loads, so the saving shrinks as the batch
grows and the union of non-zero channels fills up; past `DENSE_MIN_TOKENS` tokens the CUDA op
calls the dense matmul instead.

Grid: (token blocks, N blocks, K splits); each program accumulates its K range in fp32 and
writes a partial sum; the partials are added in torch (split-K gives a decode step enough
programs to fill the GPU).

Custom op llmaccel::sparse_down(x, weight_t, bias, sparsity): CPU = the reference
(llmaccel.ops.sparse.sparse_down), CUDA = the Triton wrapper.
"""
from __future__ import annotations

from typing import Optional

import torch

from llmaccel.kernels import cdiv
from llmaccel.ops.sparse import sparse_down as sparse_down_ref

try:  # kernels are optional: every non-CUDA path works without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is absent
    triton = None
    tl = None

HAS_TRITON = triton is not None
DENSE_MIN_TOKENS = 64  # from this many tokens on, the union of non-zeros is ~dense: use cuBLAS
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


if HAS_TRITON:
    @triton.jit
    def _sparse_down_kernel(x_ptr, w_ptr, p_ptr, M, N, K, K_PER, sx_m, sw_k, sp_s, sp_m,
                            IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr):
        pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        m = pm * BM + tl.arange(0, BM)
        n = pn * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_lo = ps * K_PER
        for k0 in range(k_lo, tl.minimum(k_lo + K_PER, K), BK):
            k = k0 + tl.arange(0, BK)
            kin = k < K
            x = tl.load(x_ptr + m[:, None] * sx_m + k[None, :], mask=(m[:, None] < M) & kin[None, :],
                        other=0.0)
            # a channel is live if any token of this block has a non-zero activation in it
            live = tl.max((x != 0).to(tl.int32), axis=0) > 0
            w = tl.load(w_ptr + k[:, None] * sw_k + n[None, :],
                        mask=(live & kin)[:, None] & (n[None, :] < N), other=0.0)
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        tl.store(p_ptr + ps * sp_s + m[:, None] * sp_m + n[None, :], acc,
                 mask=(m[:, None] < M) & (n[None, :] < N))


def _splits(M: int, N: int, K: int, device: torch.device) -> int:
    tiles = cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(cdiv(K, BLOCK_K), cdiv(4 * sms, tiles)))


def sparse_down_triton(x: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       sparsity: float = 0.0) -> torch.Tensor:
    """The Triton path at any token count (the custom op picks dense for large batches)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    K, N = weight_t.shape
    if x.shape[-1] != K:
        raise ValueError(f"sparse_down: x has {x.shape[-1]} channels, weight_t has {K} rows")
    if x.dtype != weight_t.dtype:
        raise ValueError(f"sparse_down: x is {x.dtype}, weight_t is {weight_t.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    w = weight_t.contiguous()
    M = x2.shape[0]
    out_shape = (*lead, N)
    if M == 0:
        return x.new_zeros(out_shape)
    S = _splits(M, N, K, x.device)
    k_per = cdiv(cdiv(K, S), BLOCK_K) * BLOCK_K
    S = cdiv(K, k_per)
    part = torch.empty((S, M, N), device=x.device, dtype=torch.float32)
    grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), S)
    _sparse_down_kernel[grid](x2, w, part, M, N, K, k_per, x2.stride(0), w.stride(0),
                              part.stride(0), part.stride(1), IEEE=x.dtype == torch.float32,
                              BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    out = part.sum(0) if S > 1 else part[0]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(out_shape)


@torch.library.custom_op("llmaccel::sparse_down", mutates_args=())
def sparse_down(x: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor] = None,
                sparsity: float = 0.0) -> torch.Tensor:
    return sparse_down_ref(x, weight_t, bias, sparsity=sparsity)


@sparse_down.register_kernel("cuda")
def _sparse_down_cuda(x, weight_t, bias=None, sparsity=0.0):
    tokens = x.numel() // max(1, x.shape[-1])
    if triton is None or tokens >= DENSE_MIN_TOKENS or x.dtype != weight_t.dtype:
        return sparse_down_ref(x, weight_t, bias, sparsity=sparsity)
    return sparse_down_triton(x, weight_t, bias, sparsity)


@sparse_down.register_fake
def _sparse_down_fake(x, weight_t, bias=None, sparsity=0.0):
    return x.new_empty(*x.shape[:-1], weight_t.shape[1])
