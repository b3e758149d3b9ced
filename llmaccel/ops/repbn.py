"""IR ops for RepBN (SLAB PRepBN): BatchNorm in place of LayerNorm/RMSNorm.

- `batch_norm`: inference-form BatchNorm over the channel (last) dim with fixed statistics,
  (x - mean) / sqrt(var + eps) * weight + bias. It is a per-channel affine map of x, which is
  what lets the repbn pass fold it into the linears that read it.
- `norm_affine`: x * scale + shift, the folded BN kept as an op where a reader of the norm is
  not a linear that could absorb it.
- `repbn_blend`: the progressive training form lam * Norm(x) + (1 - lam) * BN(x), Norm being
  the model's own RMSNorm (`kind="rms"`) or LayerNorm (`kind="layer"`). lam is a 0-dim tensor
  the heal schedule moves from 1 (the source model) to 0 (pure BN, the inference form). With
  `lo`/`hi` given, the BN branch reads x clamped to [lo, hi] per channel.

Statistics are fp32; the result is cast back to x's dtype as the norms do.
"""
from __future__ import annotations

import torch
import torch.fx

from llmaccel.ops import layer_norm, rms_norm

__all__ = ["batch_norm", "norm_affine", "repbn_blend"]


def batch_norm(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None,
               bias: torch.Tensor | None, *, eps: float) -> torch.Tensor:
    h = (x.float() - mean.float()) * torch.rsqrt(var.float() + eps)
    if weight is not None:
        h = h * weight.float()
    if bias is not None:
        h = h + bias.float()
    return h.to(x.dtype)


def norm_affine(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return (x.float() * scale.float() + shift.float()).to(x.dtype)


def repbn_blend(x: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None,
                bn_mean: torch.Tensor, bn_var: torch.Tensor, bn_weight: torch.Tensor | None,
                bn_bias: torch.Tensor | None, lam: torch.Tensor, lo: torch.Tensor | None = None,
                hi: torch.Tensor | None = None, *, kind: str, eps: float) -> torch.Tensor:
    # The source norm exactly as the model's own op computes it, so lam = 1 is the source model.
    if kind == "rms":
        n = rms_norm(x, norm_weight, eps=eps)
    elif kind == "layer":
        n = layer_norm(x, norm_weight, norm_bias, eps=eps)
    else:
        raise ValueError(f"repbn_blend: kind must be 'rms' or 'layer', got {kind!r}")
    # Only the BN branch sees the clamped input (see the repbn pass): the Norm branch stays exact.
    xb = x if lo is None else torch.clamp(x, lo, hi)
    bn = batch_norm(xb, bn_mean, bn_var, bn_weight, bn_bias, eps=eps)
    lam = lam.float()
    return (lam * n.float() + (1 - lam) * bn.float()).to(x.dtype)


torch.fx.wrap("batch_norm")
torch.fx.wrap("norm_affine")
torch.fx.wrap("repbn_blend")
