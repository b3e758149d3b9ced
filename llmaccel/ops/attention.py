"""Reference attention: causal softmax attention with grouped KV heads."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmaccel.ops.context import StepContext


def split_heads(x: torch.Tensor, n: int, head_dim: int) -> torch.Tensor:
    B, T, _ = x.shape
    return x.view(B, T, n, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                 mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """q (B, H, T, D) over k, v (B, Hkv, S, D); H a multiple of Hkv. Returns (B, H, T, D)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def causal_attention(q, k, v, *, n_heads: int, n_kv_heads: int, head_dim: int,
                     scale: float) -> torch.Tensor:
    qh = split_heads(q, n_heads, head_dim)
    kh = split_heads(k, n_kv_heads, head_dim)
    vh = split_heads(v, n_kv_heads, head_dim)
    return merge_heads(attend_heads(qh, kh, vh, scale=scale, causal=q.shape[1] > 1))


class ContiguousKVCache(StepContext):
    """Attention context for the reference executor: one contiguous K/V buffer per layer.

    `length` tokens are stored; a forward of T tokens writes them at [length, length + T) and
    the caller advances `length` after the whole graph has run (`advance`).
    """

    def __init__(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str):
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, device
        self.length = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer, q, k, v, *, n_heads, n_kv_heads, head_dim, scale):
        T = q.shape[1]
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} requested")
        if layer not in self.k:
            shape = (self.batch, n_kv_heads, self.max_len, head_dim)
            self.k[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        kc, vc = self.k[layer], self.v[layer]
        kc[:, :, start:end] = split_heads(k, n_kv_heads, head_dim).to(self.dtype)
        vc[:, :, start:end] = split_heads(v, n_kv_heads, head_dim).to(self.dtype)
        qh = split_heads(q, n_heads, head_dim)
        # Query t (absolute position start + t) sees keys 0 .. start + t.
        qpos = torch.arange(start, end, device=q.device)[:, None]
        mask = torch.arange(end, device=q.device)[None, :] <= qpos
        out = attend_heads(qh, kc[:, :, :end].to(q.dtype), vc[:, :, :end].to(q.dtype),
                           scale=scale, mask=mask)
        return merge_heads(out)

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        self.length = n
