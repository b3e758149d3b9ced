"""Reference attention: causal softmax attention with grouped KV heads."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmaccel.ops.context import StepContext
from llmaccel.ops.kv_int8 import SCALE_DTYPE, dequantize_rows, quantize_rows


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
    the caller advances `length` after the whole graph has run (`advance`). A layer whose node
    says kv_dtype="int8" stores int8 codes and row scales (ops/kv_int8.py) and attends over them
    dequantized.
    """

    def __init__(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str):
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, device
        self.length = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # int8 layers: (k, v) row scales

    def attend(self, layer, q, k, v, *, n_heads, n_kv_heads, head_dim, scale, kv_dtype=None):
        T = q.shape[1]
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} requested")
        if layer not in self.k:
            self._allocate(layer, n_kv_heads, head_dim, kv_dtype)
        kc, vc = self.k[layer], self.v[layer]
        kh, vh = split_heads(k, n_kv_heads, head_dim), split_heads(v, n_kv_heads, head_dim)
        if kv_dtype is None:
            kc[:, :, start:end], vc[:, :, start:end] = kh.to(self.dtype), vh.to(self.dtype)
            keys, values = kc[:, :, :end].to(q.dtype), vc[:, :, :end].to(q.dtype)
        else:  # coded from the model's dtype, as the runtime's caches receive k and v
            ks, vs = self.scales[layer]
            kc[:, :, start:end], ks[:, :, start:end] = quantize_rows(kh.to(self.dtype))
            vc[:, :, start:end], vs[:, :, start:end] = quantize_rows(vh.to(self.dtype))
            keys = dequantize_rows(kc[:, :, :end], ks[:, :, :end], q.dtype)
            values = dequantize_rows(vc[:, :, :end], vs[:, :, :end], q.dtype)
        qh = split_heads(q, n_heads, head_dim)
        # Query t (absolute position start + t) sees keys 0 .. start + t.
        qpos = torch.arange(start, end, device=q.device)[:, None]
        mask = torch.arange(end, device=q.device)[None, :] <= qpos
        return merge_heads(attend_heads(qh, keys, values, scale=scale, mask=mask))

    def _allocate(self, layer: int, n_kv_heads: int, head_dim: int, kv_dtype: str | None) -> None:
        shape = (self.batch, n_kv_heads, self.max_len, head_dim)
        dt = self.dtype if kv_dtype is None else torch.int8
        self.k[layer] = torch.zeros(shape, dtype=dt, device=self.device)
        self.v[layer] = torch.zeros(shape, dtype=dt, device=self.device)
        if kv_dtype is not None:
            self.scales[layer] = tuple(torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=self.device)
                                       for _ in range(2))

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        self.length = n
