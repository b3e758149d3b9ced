"""Quantized linear IR ops and the packing they read (layout: docs/quant-format.md).

linear_int8: symmetric int8 weights, one scale per output channel.
linear_w8a8: the same weights; x times a per-channel `smooth` factor (SmoothQuant's migration,
kept as a multiply: the rounding reads x anyway) rounded to int8 per row, absmax / 127.
linear_int4: asymmetric 4-bit weights in groups of `group_size` along the input dimension,
packed two per byte low nibble first, with per-group scales and packed 4-bit zero points,
exactly the tensors ONNX Runtime's MatMulNBits (com.microsoft, bits=4) takes:
    qweight uint8 (N, K / group_size, group_size / 2)
    scales  float (N, K / group_size)
    zeros   uint8 (N, ceil((K / group_size) / 2))
and w[n, k] = (q[n, k] - zero[n, k // group_size]) * scale[n, k // group_size].

The references dequantize the whole weight and call F.linear: they are the spec the Triton
kernels are tested against, not a fast path.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["linear_int8", "linear_w8a8", "round_rows_int8", "linear_int4", "pack_int4",
           "unpack_int4", "dequantize_int4", "dequantize_int8"]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(..., 2m) integers in [0, 15] -> (..., m) uint8; element 2i in the low nibble."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even last dimension, got {tuple(q.shape)}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """(..., m) uint8 -> (..., 2m) uint8 in [0, 15]; inverse of pack_int4."""
    lo, hi = p & 0xF, p >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def pack_zeros(z: torch.Tensor) -> torch.Tensor:
    """(N, G) zero points in [0, 15] -> (N, ceil(G / 2)) uint8, padding an odd G with 0."""
    if z.shape[-1] % 2:
        z = F.pad(z, (0, 1))
    return pack_int4(z)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The (N, K) weight in `dtype` (default: the scales' dtype)."""
    N, G, half = qweight.shape
    if 2 * half != group_size:
        raise ValueError(f"qweight blob of {half} bytes does not hold group_size {group_size}")
    q = unpack_int4(qweight).float()                     # (N, G, group_size)
    z = unpack_int4(zeros)[:, :G].float()                # (N, G)
    w = (q - z[..., None]) * scales.float()[..., None]
    return w.reshape(N, G * group_size).to(dtype or scales.dtype)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    return (qweight.float() * scales.float()[:, None]).to(dtype or scales.dtype)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (qweight * scales[:, None]).T + bias; qweight int8 (N, K), scales (N,)."""
    return F.linear(x, dequantize_int8(qweight, scales, x.dtype), bias)


def round_rows_int8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per row: codes round(x / s) (half to even) times s = absmax / 127,
    in fp32."""
    x = x.float()
    s = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return torch.round(x / s) * s


def linear_w8a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, smooth: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """round_rows_int8(x * smooth) @ (qweight * scales[:, None]).T + bias, in fp32, returned in
    x's dtype; qweight int8 (N, K), scales (N,), smooth (K,)."""
    w = dequantize_int8(qweight, scales, torch.float32)
    b = None if bias is None else bias.float()
    return F.linear(round_rows_int8(x.float() * smooth.float()), w, b).to(x.dtype)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None = None, *, group_size: int) -> torch.Tensor:
    """x @ dequantize_int4(...).T + bias, in the MatMulNBits layout above.

    K = x.shape[-1] may be less than the stored columns: the last group is then zero-padded,
    as MatMulNBits pads K up to whole blocks.
    """
    w = dequantize_int4(qweight, scales, zeros, group_size, x.dtype)
    return F.linear(x, w[:, : x.shape[-1]], bias)


torch.fx.wrap("linear_int8")
torch.fx.wrap("linear_w8a8")
torch.fx.wrap("linear_int4")
