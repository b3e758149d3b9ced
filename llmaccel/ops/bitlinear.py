"""BitLinear IR ops (BitNet b1.58): ternary weights, per-token int8 activations.

Inference form
--------------
    bitlinear(x, w_packed, w_scale, bias, *, in_features, out_features)
    rms_norm_bitlinear(x, norm_weight, w_packed, w_scale, bias, *, eps, in_features, out_features)
        = bitlinear(rms_norm(x, norm_weight, eps=eps), ...)    (the MatMul-free LM fusion)

Semantics (fp32 throughout, the result cast to x's dtype):
    h    = x as fp32 (for the fused op: the rms_norm output, rounded as ops.rms_norm rounds)
    inv  = 127 / max(max_k |h_k|, 1e-5)                     per token
    q    = clamp(round_half_even(h * inv), -128, 127)        int8 codes
    acc  = q @ T^T                                           T ternary (N, K); exact integers
    y    = acc / inv * w_scale + bias
`acc` is a sum of at most K products of magnitude <= 127: exact in int32 (a kernel) and in
fp32 (this reference) for K < 2^17, so a kernel can match the reference bit for bit up to the
order-free parts (rounding of h). w_scale (N,) holds each output row's scale: per-tensor
absmean (BitNet b1.58) stores one value repeated over the rows of its linear, per-channel one
absmean per row; one shape serves both and lets linears with different per-tensor scales be
concatenated into one op (q, k, v reading one norm output).

Weight layout (w_packed: uint8, (N, Kp / 4), Kp = in_features rounded up to 64)
-------------------------------------------------------------------------------
Each row is cut into blocks of 64 columns; block b is 16 bytes. Byte j (0..15) of block b holds
columns 64b + j + 16s for s = 0..3 in bits 2s..2s+1, as the code t + 1 (0: -1, 1: 0, 2: +1;
3 unused). Padding columns hold code 1 (weight 0). The interleave lets a kernel that unpacks
plane s of a byte vector read x at 16 consecutive columns instead of every fourth one.
Stored: 2 bits per weight + one scale per row.

Training form (emitted when `heal` follows the bitlinear pass)
--------------------------------------------------------------
bitlinear_train / rms_norm_bitlinear_train keep fp latent weights and quantize weights and
activations in the forward with a straight-through estimator, v + lam * (Q(v) - v).detach();
lam (a 0-d tensor) ramps the quantization in during healing (1 = full quantization, the value
the inference form computes). `segments` gives the rows of each concatenated linear, the unit of
a per-tensor scale.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel.ops import rms_norm

__all__ = ["bitlinear", "rms_norm_bitlinear", "bitlinear_train", "rms_norm_bitlinear_train",
           "pack_ternary", "unpack_ternary", "ternarize", "act_quant", "BLOCK", "SCALES"]

BLOCK = 64          # columns per packed block (16 bytes)
SCALES = ("per_tensor", "per_channel")
_EPS = 1e-5         # floor of the absmax / absmean denominators, as in BitNet


def padded_in(in_features: int) -> int:
    return -(-in_features // BLOCK) * BLOCK


def pack_ternary(t: torch.Tensor) -> torch.Tensor:
    """(N, K) values in {-1, 0, 1} -> (N, Kp / 4) uint8 in the layout above."""
    N, K = t.shape
    codes = F.pad(t.to(torch.int16) + 1, (0, padded_in(K) - K), value=1).to(torch.uint8)
    c = codes.view(N, -1, 4, BLOCK // 4)                  # (N, blocks, plane s, byte j)
    packed = c[:, :, 0] | (c[:, :, 1] << 2) | (c[:, :, 2] << 4) | (c[:, :, 3] << 6)
    return packed.reshape(N, -1)


def unpack_ternary(p: torch.Tensor, in_features: int) -> torch.Tensor:
    """(N, Kp / 4) uint8 -> (N, in_features) int8 in {-1, 0, 1}; inverse of pack_ternary."""
    N = p.shape[0]
    b = p.view(N, -1, BLOCK // 4)
    planes = torch.stack([(b >> (2 * s)) & 3 for s in range(4)], dim=2)   # (N, blocks, 4, 16)
    return (planes.reshape(N, -1)[:, :in_features].to(torch.int8) - 1)


def ternarize(w: torch.Tensor, scale: str = "per_tensor",
              segments: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BitNet b1.58 absmean quantization: w ~ t * s[:, None], t in {-1, 0, 1} (as w's float).

    per_tensor: one absmean per segment of rows (one original linear); per_channel: per row.
    Returns (t, s) with s of shape (N,), fp32.
    """
    wf = w.float()
    if scale == "per_channel":
        s = wf.abs().mean(1)
    elif scale == "per_tensor":
        segs = segments or (wf.shape[0],)
        s = torch.cat([part.abs().mean().expand(part.shape[0])
                       for part in wf.split(list(segs), 0)])
    else:
        raise ValueError(f"unknown bitlinear scale {scale!r}; expected one of {SCALES}")
    s = s.clamp_min(_EPS)
    return (wf / s[:, None]).round().clamp(-1, 1), s


def act_quant(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8 codes (as fp32) of fp32 h, and inv = 127 / absmax (..., 1)."""
    amax = h.abs().amax(-1, keepdim=True).clamp_min(_EPS)
    # A tensor numerator: `127.0 / t` is computed as 127 * reciprocal(t), one rounding more
    # than the IEEE division a kernel does.
    inv = amax.new_full((), 127.0) / amax
    return (h * inv).round().clamp(-128, 127), inv


def bitlinear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, *, in_features: int, out_features: int) -> torch.Tensor:
    h = x.float()
    q, inv = act_quant(h)
    t = unpack_ternary(w_packed, in_features).to(h.device, torch.float32)
    y = (q @ t.T) / inv * w_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def rms_norm_bitlinear(x: torch.Tensor, norm_weight: torch.Tensor | None, w_packed: torch.Tensor,
                       w_scale: torch.Tensor, bias: torch.Tensor | None = None, *, eps: float,
                       in_features: int, out_features: int) -> torch.Tensor:
    h = rms_norm(x, norm_weight, eps=eps)
    return bitlinear(h, w_packed, w_scale, bias, in_features=in_features,
                     out_features=out_features).to(x.dtype)


def bitlinear_train(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    lam: torch.Tensor, *, scale: str, segments: tuple[int, ...]) -> torch.Tensor:
    """Fake-quantized linear with straight-through gradients to x and the latent weight."""
    h = x.float()
    with torch.no_grad():
        q, inv = act_quant(h)
        t, s = ternarize(weight, scale, segments)
    lam = lam.float()
    hq = h + lam * (q / inv - h).detach()
    wf = weight.float()
    wq = wf + lam * (t * s[:, None] - wf).detach()
    return F.linear(hq, wq, None if bias is None else bias.float()).to(x.dtype)


def rms_norm_bitlinear_train(x: torch.Tensor, norm_weight: torch.Tensor | None,
                             weight: torch.Tensor, bias: torch.Tensor | None, lam: torch.Tensor, *,
                             eps: float, scale: str, segments: tuple[int, ...]) -> torch.Tensor:
    h = rms_norm(x, norm_weight, eps=eps)
    return bitlinear_train(h, weight, bias, lam, scale=scale, segments=segments).to(x.dtype)


torch.fx.wrap("bitlinear")
torch.fx.wrap("rms_norm_bitlinear")
torch.fx.wrap("bitlinear_train")
torch.fx.wrap("rms_norm_bitlinear_train")
