"""KIVI KV-cache quantization: the IR op, quantize/pack references and the quantized cache.

Format (shared by the reference cache, the Triton kernels and, later, the paged runtime):
- keys (after RoPE) are quantized per channel over groups of G consecutive tokens: one
  (scale, min) pair per group and channel, shape (..., S / G, D);
- values are quantized per token over groups of Gv channels along head_dim: shape (..., S, D / Gv);
- asymmetric: x ~ code * scale + min, code = floor((x - min) / scale + 0.5) in [0, 2^bits - 1],
  scale = (max - min) / (2^bits - 1); scale and min are stored in the cache dtype and the codes
  are computed from the stored values (so every reader dequantizes identically);
- codes packed along head_dim, 8 / bits per byte, element PER*j + i in bits [i*bits, (i+1)*bits)
  of byte j (low bits first), so a token row is D * bits / 8 bytes;
- the R most recent tokens stay in full precision; whenever R + G of them are held, the oldest
  G are quantized, so a cache filled to L tokens holds G * floor(max(0, L - R) / G) quantized
  (a truncation, e.g. a speculative rollback, never re-expands tokens already quantized).

The spec travels as the `kv_quant` kwarg of `kv_quant_attention` (a dict: bits, group, residual,
value_group). With ctx None (a whole-sequence forward with no cache) the op is plain causal
attention and the spec is ignored: quality must be measured through the cache.
"""
from __future__ import annotations

import torch
import torch.fx

from llmaccel.errors import LlmaccelError
from llmaccel.ops.attention import attend_heads, causal_attention, merge_heads, split_heads
from llmaccel.ops.context import HINT, StepContext

BITS = (2, 4)


def make_spec(bits: int, group: int, residual: int, head_dim: int, *, where: str = "") -> dict:
    """The kv_quant kwarg for one attention layer; values are grouped min(group, head_dim) wide."""
    if bits not in BITS:
        raise LlmaccelError(f"kvquant: bits must be 2 or 4, got {bits}")
    if group < 1 or residual < 0 or residual % group:
        raise LlmaccelError(f"kvquant: residual ({residual}) must be a non-negative multiple of "
                            f"group ({group})")
    vg = min(group, head_dim)
    if head_dim % vg or vg % (8 // bits):
        raise LlmaccelError(f"kvquant: {where or 'attention'} head_dim {head_dim} does not split "
                            f"into value groups of {vg} channels packed {8 // bits} per byte")
    return {"bits": bits, "group": group, "residual": residual, "value_group": vg}


def quantized_len(length: int, spec: dict | None) -> int:
    """Tokens held quantized when `length` are stored (the rest, at least R, stay full precision)."""
    if spec is None:
        return 0
    g = spec["group"]
    return g * (max(0, length - spec["residual"]) // g)


def bytes_per_token(spec: dict, n_kv_heads: int, head_dim: int, *, scale_bytes: int = 2) -> float:
    """Steady-state bytes per token per layer for K and V (codes + amortised scales and mins)."""
    codes = 2 * head_dim * spec["bits"] / 8
    k_meta = 2 * head_dim * scale_bytes / spec["group"]
    v_meta = 2 * (head_dim // spec["value_group"]) * scale_bytes
    return n_kv_heads * (codes + k_meta + v_meta)


# --- quantize / pack references ---------------------------------------------------------------

def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., D) -> (..., D * bits / 8) bytes, low bits first."""
    per = 8 // bits
    c = codes.to(torch.uint8).view(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= c[..., i] << (i * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (i * bits)) & mask for i in range(per)]
    return torch.stack(parts, -1).view(*packed.shape[:-1], packed.shape[-1] * per)


def _minmax_quantize(x: torch.Tensor, dim: int, bits: int, store: torch.dtype):
    """Asymmetric codes over `dim`; scale and min rounded to `store` before the codes are taken."""
    qmax = (1 << bits) - 1
    xf = x.float()
    mn = xf.amin(dim, keepdim=True)
    scale = ((xf.amax(dim, keepdim=True) - mn) / qmax).to(store)
    mn = mn.to(store)
    s32, m32 = scale.float(), mn.float()
    inv = torch.where(s32 > 0, 1.0 / torch.where(s32 > 0, s32, 1.0), 0.0)
    codes = torch.floor((xf - m32) * inv + 0.5).clamp_(0, qmax).to(torch.uint8)
    return codes, scale, mn


def quantize_keys(k: torch.Tensor, bits: int, group: int):
    """k (..., T, D), T a multiple of group -> packed (..., T, D*bits/8), scale, min (..., T/group, D)."""
    *lead, T, D = k.shape
    g = k.reshape(*lead, T // group, group, D)
    codes, scale, mn = _minmax_quantize(g, -2, bits, k.dtype)
    return pack(codes.reshape(*lead, T, D), bits), scale.squeeze(-2), mn.squeeze(-2)


def dequantize_keys(packed, scale, mn, bits: int, group: int) -> torch.Tensor:
    codes = unpack(packed, bits).float()
    *lead, T, D = codes.shape
    g = codes.view(*lead, T // group, group, D) * scale.float()[..., None, :] + mn.float()[..., None, :]
    return g.view(*lead, T, D).to(scale.dtype)


def quantize_values(v: torch.Tensor, bits: int, group: int):
    """v (..., T, D) -> packed (..., T, D*bits/8), scale, min (..., T, D/group)."""
    *lead, T, D = v.shape
    g = v.reshape(*lead, T, D // group, group)
    codes, scale, mn = _minmax_quantize(g, -1, bits, v.dtype)
    return pack(codes.reshape(*lead, T, D), bits), scale.squeeze(-1), mn.squeeze(-1)


def dequantize_values(packed, scale, mn, bits: int, group: int) -> torch.Tensor:
    codes = unpack(packed, bits).float()
    *lead, T, D = codes.shape
    g = codes.view(*lead, T, D // group, group) * scale.float()[..., None] + mn.float()[..., None]
    return g.view(*lead, T, D).to(scale.dtype)


def decode_attention_ref(q, kp, ks, km, vp, vs, vm, kr, vr, n_quant, n_res, *, scale: float,
                         bits: int, group: int, value_group: int) -> torch.Tensor:
    """One query token per sequence over its quantized tokens, then its full-precision ones.

    q (B, H, D); kp/vp (B, Hkv, Sq, D*bits/8); ks/km (B, Hkv, Sq/group, D); vs/vm (B, Hkv, Sq,
    D/value_group); kr/vr (B, Hkv, Sr, D); n_quant, n_res (B,) int: tokens in use per sequence
    (n_quant a multiple of group). Returns (B, H, D) in q's dtype.
    """
    outs = []
    for b in range(q.shape[0]):
        nq, nr = int(n_quant[b]), int(n_res[b])
        k = dequantize_keys(kp[b, :, :nq], ks[b, :, :nq // group], km[b, :, :nq // group], bits, group)
        v = dequantize_values(vp[b, :, :nq], vs[b, :, :nq], vm[b, :, :nq], bits, value_group)
        k = torch.cat([k.float(), kr[b, :, :nr].float()], 1)
        v = torch.cat([v.float(), vr[b, :, :nr].float()], 1)
        outs.append(attend_heads(q[b, :, None].float()[None], k[None], v[None], scale=scale)[0, :, 0])
    return torch.stack(outs).to(q.dtype)


# --- the IR op ----------------------------------------------------------------------------------

def kv_quant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx, *, layer: int,
                       n_heads: int, n_kv_heads: int, head_dim: int, scale: float,
                       kv_quant: dict) -> torch.Tensor:
    """`attention` whose KV cache is KIVI-quantized as `kv_quant` says.

    ctx None: a whole-sequence forward with no cache, plain causal attention (the spec is
    ignored). Otherwise the context must quantize this layer as the spec says; a context that
    does not (e.g. a ContiguousKVCache) is refused rather than silently run in full precision.
    """
    if ctx is None:
        return causal_attention(q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                head_dim=head_dim, scale=scale)
    if ctx.kv_quant_spec(layer) != kv_quant:
        raise LlmaccelError(f"attention layer {layer} expects a KV cache quantized as {kv_quant}; {HINT}")
    return ctx.attend(layer, q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=head_dim, scale=scale)


torch.fx.wrap("kv_quant_attention")


# --- the quantized cache ------------------------------------------------------------------------

class _LayerStore:
    """One layer: packed quantized prefix (preallocated) + full-precision residual tail."""

    def __init__(self, B: int, H: int, D: int, cap: int, spec: dict | None, dtype, device):
        self.spec, self.n_q = spec, 0
        self.kr = torch.zeros(B, H, 0, D, dtype=dtype, device=device)
        self.vr = torch.zeros(B, H, 0, D, dtype=dtype, device=device)
        if spec is None:
            return
        b, g, vg = spec["bits"], spec["group"], spec["value_group"]
        cap -= cap % g
        pd = D * b // 8
        self.kp = torch.zeros(B, H, cap, pd, dtype=torch.uint8, device=device)
        self.vp = torch.zeros(B, H, cap, pd, dtype=torch.uint8, device=device)
        self.ks = torch.zeros(B, H, cap // g, D, dtype=dtype, device=device)
        self.km = torch.zeros_like(self.ks)
        self.vs = torch.zeros(B, H, cap, D // vg, dtype=dtype, device=device)
        self.vm = torch.zeros_like(self.vs)

    @property
    def length(self) -> int:
        return self.n_q + self.kr.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kr = torch.cat([self.kr, k], 2)
        self.vr = torch.cat([self.vr, v], 2)
        target = quantized_len(self.length, self.spec)
        while self.n_q < target:  # the oldest G residual tokens age into the quantized store
            self._flush()

    def _flush(self) -> None:
        b, g, vg = self.spec["bits"], self.spec["group"], self.spec["value_group"]
        s, gi = self.n_q, self.n_q // g
        self.kp[:, :, s:s + g], ks, km = quantize_keys(self.kr[:, :, :g], b, g)
        self.ks[:, :, gi:gi + 1], self.km[:, :, gi:gi + 1] = ks, km
        self.vp[:, :, s:s + g], self.vs[:, :, s:s + g], self.vm[:, :, s:s + g] = \
            quantize_values(self.vr[:, :, :g], b, vg)
        self.kr, self.vr = self.kr[:, :, g:], self.vr[:, :, g:]
        self.n_q += g

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the quantized tokens, dequantized."""
        n = self.n_q
        if n == 0:
            return self.kr[:, :, :0], self.vr[:, :, :0]
        b, g, vg = self.spec["bits"], self.spec["group"], self.spec["value_group"]
        k = dequantize_keys(self.kp[:, :, :n], self.ks[:, :, :n // g], self.km[:, :, :n // g], b, g)
        v = dequantize_values(self.vp[:, :, :n], self.vs[:, :, :n], self.vm[:, :, :n], b, vg)
        return k, v

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.dequantized()
        return torch.cat([k, self.kr], 2), torch.cat([v, self.vr], 2)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens. Quantization is never undone for tokens that stay in whole
        groups; a group cut in two comes back dequantized (lossy) into the residual."""
        if n >= self.n_q:
            self.kr, self.vr = self.kr[:, :, :n - self.n_q], self.vr[:, :, :n - self.n_q]
            return
        keep = n - n % self.spec["group"]
        k, v = self.dequantized()
        self.kr, self.vr = k[:, :, keep:n].contiguous(), v[:, :, keep:n].contiguous()
        self.n_q = keep


class QuantizedKVCache(StepContext):
    """Attention context with a KIVI-quantized KV cache (same protocol as ContiguousKVCache).

    `specs` maps layer -> kv_quant spec; a layer without one is kept in full precision.
    """

    def __init__(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
                 specs: dict[int, dict]):
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, device
        self.specs = dict(specs)
        self.length = 0
        self.layers: dict[int, _LayerStore] = {}

    def kv_quant_spec(self, layer: int) -> dict | None:
        return self.specs.get(layer)

    def attend(self, layer, q, k, v, *, n_heads, n_kv_heads, head_dim, scale):
        T = q.shape[1]
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} requested")
        if layer not in self.layers:
            self.layers[layer] = _LayerStore(self.batch, n_kv_heads, head_dim, self.max_len,
                                             self.specs.get(layer), self.dtype, self.device)
        st = self.layers[layer]
        if st.length != start:  # a re-run of the same step overwrites, as ContiguousKVCache does
            st.truncate(start)
        st.append(split_heads(k, n_kv_heads, head_dim).to(self.dtype),
                  split_heads(v, n_kv_heads, head_dim).to(self.dtype))
        kc, vc = st.keys_values()
        qpos = torch.arange(start, end, device=q.device)[:, None]
        mask = torch.arange(end, device=q.device)[None, :] <= qpos
        out = attend_heads(split_heads(q, n_heads, head_dim), kc.to(q.dtype), vc.to(q.dtype),
                           scale=scale, mask=mask)
        return merge_heads(out)

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        for st in self.layers.values():
            if st.length > n:
                st.truncate(n)
        self.length = n

    def nbytes(self) -> int:
        """Bytes the cache holds now: packed codes, the scales and mins in use, the residual."""
        total = 0
        for st in self.layers.values():
            total += st.kr.nbytes + st.vr.nbytes
            if st.spec is not None:
                n, g = st.n_q, st.spec["group"]
                for t, rows in ((st.kp, n), (st.vp, n), (st.ks, n // g), (st.km, n // g),
                                (st.vs, n), (st.vm, n)):
                    total += t[:, :, :rows].nbytes
        return total
