"""Rotary position embedding frequencies (default, linear and llama3 scaling)."""
from __future__ import annotations

import math

import torch

from llmaccel.errors import LlmaccelError

ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse RoPE frequencies, with the scaling the config names (default, linear, llama3)."""
    d = head_dim
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        return torch.where(medium, smoothed, scaled)
    raise LlmaccelError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def rope_at(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
            head_dim: int) -> torch.Tensor:
    """ops.rope's math with the frequencies given (fp32, on x's device), so that a caller that
    runs it many times (a compiled training step) computes them once."""
    B, T, _ = x.shape
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, :, None, :]
    sin = emb.sin().to(x.dtype)[:, :, None, :]
    h = x.view(B, T, -1, head_dim)
    x1, x2 = h[..., : head_dim // 2], h[..., head_dim // 2:]
    rot = torch.cat((-x2, x1), dim=-1)
    return (h * cos + rot * sin).reshape(B, T, -1)


def rope_table(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, *,
               head_dim: int) -> torch.Tensor:
    """ops.rope with cos/sin (max_len, head_dim) looked up by position; same values as the op."""
    B, T, _ = x.shape
    c = cos[positions].to(x.dtype)[:, :, None, :]
    s = sin[positions].to(x.dtype)[:, :, None, :]
    h = x.view(B, T, -1, head_dim)
    x1, x2 = h[..., : head_dim // 2], h[..., head_dim // 2:]
    rot = torch.cat((-x2, x1), dim=-1)
    return (h * c + rot * s).reshape(B, T, -1)
