"""The 8-bit KV cache (kvquant.bits=8): int8 codes with one scale per token and KV head.

Format: each stored key or value row x (head_dim numbers of one token and KV head) is kept as
code = floor(x / s + 0.5) in [-127, 127] with s = max|x| / 127 rounded to fp16, the codes computed
from the rounded scale (x ~ code * s); the scales sit beside the codes, one per (slot, KV head).
The decode kernel that quantizes a new row in registers computes the same formula, but a code
may differ by one step where its product rounds across a half (CUDA's fast division); every
reader then dequantizes what was stored. Bytes per token and head: head_dim + 2 (66
against bf16's 128 at head_dim 64).

Why not fp8 e4m3 with a scale per layer (vLLM's and TensorRT-LLM's fp8 cache): on SmolLM2-135M
(wikitext2 second half, ctx 512) it costs +1.18% perplexity (KL 0.0067), +0.48% with a Hadamard
rotation of the keys, where this format costs +0.15% (KL 0.0006). e4m3 keeps 3 mantissa bits
over its whole range, so every key carries up to 6% error, and the keys' large channels turn
that into attention-logit error; a row scale gives every value a step of max|x| / 254.

With ctx None (a whole-sequence forward) the attention is unchanged, as for KIVI: quality is
measured through the cache.
"""
from __future__ import annotations

import torch

KV_DTYPES = ("int8",)   # what an attention node's kv_dtype may say (None: the model's dtype)
SCALE_DTYPE = torch.float16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> int8 codes (..., D) and fp16 scales (...)."""
    xf = x.float()
    # a product, not a quotient, and floor(y + 0.5): the formula the Triton writer follows
    s = (xf.abs().amax(-1) * (1.0 / 127)).to(SCALE_DTYPE)
    s32 = s.float()
    inv = torch.where(s32 > 0, 1.0 / torch.where(s32 > 0, s32, 1.0), 0.0)
    codes = torch.floor(xf * inv[..., None] + 0.5).clamp_(-127, 127).to(torch.int8)
    return codes, s


def row_bytes(n_kv_heads: int, head_dim: int) -> int:
    """Bytes of one token's K and V rows of one layer in the int8 cache: codes plus a scale per
    KV head (132 at 2 x 64 against bf16's 256)."""
    return 2 * n_kv_heads * (head_dim + SCALE_DTYPE.itemsize)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float()[..., None]).to(dtype)


def int8_layers(gm: torch.fx.GraphModule) -> set[int]:
    """The attention layers of the graph whose cache holds int8 codes."""
    return {int(n.kwargs["layer"]) for n in gm.graph.nodes
            if n.op == "call_function" and n.kwargs.get("kv_dtype") == "int8"}


__all__ = ["KV_DTYPES", "SCALE_DTYPE", "quantize_rows", "row_bytes", "dequantize_rows", "int8_layers"]
