"""Static KV cache: an attention context of fixed shapes, for torch.compile and CUDA graphs.

Each layer has K/V buffers of (batch, n_kv_heads, max_len, head_dim), allocated once at
static addresses. A forward is bound to the positions it computes (`bind(pos)`, pos of shape
(T,), the same for every row of the static batch); attention writes k/v at those positions
with index_copy_ and attends over the whole buffer under a mask that the positions define,
so a decode step has the same shapes at every position and one CUDA graph replays them all.
Stale entries past the current position are masked, so the cache never needs clearing.
`fused` decode attention (one query per row) is one custom op per layer that writes k, v and
attends over slots 0 .. pos only (llmaccel/kernels/static_attention.py); other forwards of a
fused cache (prefill, speculative verification) run `grouped`. `rows` (the CPU default) writes
the decode attention as broadcast products and sums that Inductor compiles into fused loops.
`fuse_rope` hands q and k to a fused decode attention before their rotary embedding, which the
kernel applies (one launch per layer for RoPE, the KV write and attention).

Layers whose attention is `kv_quant_attention` (the `kvquant` pass) keep a KIVI-quantized cache
instead (llmaccel/kernels/static_kivi.py: packed codes, scales and a ring of full-precision
recent tokens), read and written as the reference QuantizedKVCache does: a forward of several
tokens must start at position 0 (the prefill), a one-token forward is a decode step
(`llmaccel::static_kivi_decode`, Triton on CUDA, the reference elsewhere).
"""
from __future__ import annotations

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

import llmaccel.kernels.kivi  # noqa: F401  (registers llmaccel::kivi_quantize_*, used by the prefill)
import llmaccel.kernels.static_attention  # noqa: F401  (registers llmaccel::static_decode_attention)
from llmaccel import ops
from llmaccel.codegen.lower import _retarget, attention_layers, rope_table
from llmaccel.errors import LlmaccelError
from llmaccel.kernels.static_kivi import CACHE_NAMES, cache_shapes, static_kivi_prefill, triton_supports
from llmaccel.ops.attention import merge_heads, split_heads

ATTN_IMPLS = ("sdpa", "grouped", "fused", "rows")


class StaticKVCache(nn.Module):
    """specs: layer -> KIVI spec (ops.kvquant.make_spec) for the layers kept quantized."""

    def __init__(self, layers: dict[int, tuple[int, int]], batch: int, max_len: int,
                 dtype: torch.dtype, device, specs: dict[int, dict] | None = None):
        super().__init__()
        self.batch, self.max_len, self.dtype = batch, max_len, dtype
        self.layer_ids = sorted(layers)
        self.specs = dict(specs or {})
        for i, (n_kv, hd) in layers.items():
            if i in self.specs:
                if torch.device(device).type == "cuda" and not triton_supports(hd, self.specs[i]):
                    raise LlmaccelError(f"layer {i}: the static KIVI cache on CUDA needs a power-of-two "
                                        f"head_dim >= 16 and power-of-two groups (head_dim {hd}, "
                                        f"kv_quant {self.specs[i]}); use the runtime")
                shapes = cache_shapes(batch, n_kv, hd, max_len, self.specs[i])
                bufs = {n: torch.zeros(shapes[n], device=device,
                                       dtype=torch.uint8 if n in ("kp", "vp") else dtype)
                        for n in CACHE_NAMES}
            else:
                bufs = {n: torch.zeros(batch, n_kv, max_len, hd, dtype=dtype, device=device)
                        for n in ("k", "v")}
            for name, buf in bufs.items():
                self.register_buffer(f"{name}{i}", buf, persistent=False)
                # Dynamo must treat the buffers as fixed inputs that the graph mutates in place.
                torch._dynamo.mark_static_address(buf)
        self.register_buffer("slots", torch.arange(max_len, device=device), persistent=False)
        torch._dynamo.mark_static_address(self.slots)

    @classmethod
    def for_graph(cls, gm: torch.fx.GraphModule, batch: int, max_len: int, dtype, device):
        from llmaccel.compiler.executor import kv_quant_specs

        return cls(attention_layers(gm), batch, max_len, dtype, device, kv_quant_specs(gm))

    def kivi_buffers(self, layer: int) -> list[torch.Tensor]:
        return [getattr(self, f"{n}{layer}") for n in CACHE_NAMES]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n != "slots")

    def bind(self, pos: torch.Tensor, attn: str = "sdpa") -> "BoundCache":
        """attn: one of ATTN_IMPLS, or "prefill" for a forward at positions 0 .. T - 1 (its
        attention is causal over its own keys: flash attention, no mask over the buffer)."""
        return BoundCache(self, pos, attn)


class BoundCache:
    """The attention context for one forward at positions `pos` (T,)."""

    def __init__(self, cache: StaticKVCache, pos: torch.Tensor, attn: str):
        self.cache, self.pos, self.attn = cache, pos, attn
        # Query at position p sees slots 0 .. p; computed once, shared by every layer.
        self.mask = cache.slots[None, :] <= pos[:, None]

    def kv_quant_spec(self, layer: int) -> dict | None:
        return self.cache.specs.get(layer)

    def attend(self, layer, q, k, v, *, n_heads, n_kv_heads, head_dim, scale, rope=None):
        """rope: None, or (cos, sin, positions) when q and k still lack their rotary embedding;
        k = v = None when q is the fused projection (graphs rewritten by `fuse_rope`)."""
        c = self.cache
        if layer in c.specs:
            q, k, v = _unfused(q, k, v, rope, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
            return self._attend_kivi(layer, q, k, v, n_heads, n_kv_heads, head_dim, scale)
        kc, vc = getattr(c, f"k{layer}"), getattr(c, f"v{layer}")
        B, T = q.shape[0], q.shape[1]
        if self.attn == "fused" and T == 1:
            tables = rope[:2] if rope is not None else (None, None)
            if k is None:  # q is the fused projection (B, 1, (H + 2 Hkv) D)
                args = (q.reshape(B, n_heads + 2 * n_kv_heads, head_dim), None, None)
            else:
                args = (q.reshape(B, n_heads, head_dim), k.reshape(B, n_kv_heads, head_dim),
                        v.reshape(B, n_kv_heads, head_dim))
            out = torch.ops.llmaccel.static_decode_attention(*args, kc, vc, self.pos, *tables, scale=scale)
            return out.reshape(B, 1, n_heads * head_dim)
        q, k, v = _unfused(q, k, v, rope, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
        kh = split_heads(k, n_kv_heads, head_dim).to(kc.dtype)
        vh = split_heads(v, n_kv_heads, head_dim).to(vc.dtype)
        kc.index_copy_(2, self.pos, kh)
        vc.index_copy_(2, self.pos, vh)
        qh = split_heads(q, n_heads, head_dim)
        if self.attn == "prefill":  # positions 0 .. T - 1: causal over this forward's keys alone
            out = F.scaled_dot_product_attention(qh, kh.to(q.dtype), vh.to(q.dtype), is_causal=True,
                                                 scale=scale, enable_gqa=n_heads != n_kv_heads)
        elif self.attn == "rows" and T == 1:
            out = rows_attention(qh, kc, vc, self.mask, scale)
        elif self.attn != "sdpa":  # grouped, and the forwards of more than one query
            out = grouped_attention(qh, kc, vc, self.mask, scale)
        else:
            out = F.scaled_dot_product_attention(qh, kc.to(q.dtype), vc.to(q.dtype), attn_mask=self.mask,
                                                 scale=scale, enable_gqa=n_heads != n_kv_heads)
        return merge_heads(out)

    def _attend_kivi(self, layer, q, k, v, n_heads, n_kv_heads, head_dim, scale):
        spec, bufs = self.cache.specs[layer], self.cache.kivi_buffers(layer)
        B, T = q.shape[0], q.shape[1]
        if T == 1:
            out = torch.ops.llmaccel.static_kivi_decode(
                q.reshape(B, n_heads, head_dim), k.reshape(B, n_kv_heads, head_dim),
                v.reshape(B, n_kv_heads, head_dim), *bufs, self.pos, scale=scale, **spec)
            return out.reshape(B, 1, n_heads * head_dim)
        # The prefill (positions 0 .. T - 1, callers guarantee it): the prompt attends over its
        # keys and values as the quantized cache holds them, causally.
        keys, values = static_kivi_prefill(split_heads(k, n_kv_heads, head_dim),
                                           split_heads(v, n_kv_heads, head_dim), *bufs, spec)
        out = F.scaled_dot_product_attention(split_heads(q, n_heads, head_dim), keys.to(q.dtype),
                                             values.to(q.dtype), is_causal=True, scale=scale,
                                             enable_gqa=n_heads != n_kv_heads)
        return merge_heads(out)


def _unfused(q, k, v, rope, *, n_heads: int, n_kv_heads: int, head_dim: int):
    """q, k, v as ops.attention takes them, from attention_rope's arguments: split out of the
    fused projection (k = v = None) and rotated (rope = (cos, sin, positions), or None)."""
    if k is None:
        q, k, v = q.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    if rope is not None:
        q = rope_table(q, *rope, head_dim=head_dim)
        k = rope_table(k, *rope, head_dim=head_dim)
    return q, k, v


def attention_rope(q, k, v, ctx, cos, sin, positions, *, layer: int, n_heads: int, n_kv_heads: int,
                   head_dim: int, scale: float) -> torch.Tensor:
    """ops.attention with q and k before their rotary embedding (cos / sin tables by position);
    k = v = None: q is the fused projection (B, T, (H + 2 Hkv) D). A static-cache context takes
    the tables as they are (its fused decode kernel rotates at the cache's position); without a
    context (a plain causal forward) q and k are rotated here."""
    if ctx is not None:
        return ctx.attend(layer, q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                          scale=scale, rope=(cos, sin, positions))
    q, k, v = _unfused(q, k, v, (cos, sin, positions), n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=head_dim)
    return ops.attention(q, k, v, None, layer=layer, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         head_dim=head_dim, scale=scale)


def _same(a):
    """What identifies a node argument: the stored tensor a get_attr reads (each rope node reads
    the tables through its own get_attr), else the node itself."""
    return ("attr", a.target) if isinstance(a, torch.fx.Node) and a.op == "get_attr" else a


def _split_parts(q, k, v, sizes):
    """The fused projection whose split gives q, k, v (getitems 0, 1, 2 of one split along the
    last dim into `sizes`, used by nothing else), or None."""
    parts = [x.args if isinstance(x, torch.fx.Node) and x.target is operator.getitem else None
             for x in (q, k, v)]
    if any(p is None for p in parts) or [p[1] for p in parts] != [0, 1, 2]:
        return None
    split = parts[0][0]
    if any(p[0] is not split for p in parts) or split.op != "call_method" or split.target != "split" \
            or split.kwargs.get("dim") != -1 or len(split.users) != 3 or list(split.args[1]) != sizes:
        return None
    return split


def fuse_rope(gm: torch.fx.GraphModule) -> int:
    """Rewrite attention(rope_table(q), rope_table(k), v) into attention_rope(q, k, v, tables) in
    a lowered graph, in place, where both rotations read the same tables and positions and feed
    only the attention; where q, k, v are the three parts of one fused projection, the
    projection itself is handed over (k = v = None), so it is stored once as one buffer.
    Returns how many attention nodes were rewritten."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not ops.attention:
            continue
        rq, rk = node.args[0], node.args[1]
        if not all(isinstance(r, torch.fx.Node) and r.target is rope_table and len(r.users) == 1
                   for r in (rq, rk)):
            continue
        if [_same(a) for a in rq.args[1:]] != [_same(a) for a in rk.args[1:]] or rq.kwargs != rk.kwargs:
            continue
        kw = node.kwargs
        D = kw["head_dim"]
        if rq.kwargs.get("head_dim") != D or D % 2:  # the kernel rotates whole heads of the attention
            continue
        cos, sin, positions = rq.args[1:4]
        q, k, v = rq.args[0], rk.args[0], node.args[2]
        split = _split_parts(q, k, v, [kw["n_heads"] * D, kw["n_kv_heads"] * D, kw["n_kv_heads"] * D])
        if split is not None:
            q, k, v = split.args[0], None, None
        _retarget(node, attention_rope)
        node.args = (q, k, v, node.args[3], cos, sin, positions)
        tables = rk.args[1:3]  # the second rotation's own reads of the tables
        for r in (rq, rk):
            gm.graph.erase_node(r)
        dead = [*tables] + ([] if split is None else [*split.users, split])
        for a in dead:
            if isinstance(a, torch.fx.Node) and not a.users:
                gm.graph.erase_node(a)
        n += 1
    if n:
        gm.graph.lint()
        gm.recompile()
    return n


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Masked attention with the query heads of a KV group stacked as rows of one matmul.

    q (B, H, T, D), k/v (B, Hkv, S, D), mask (T, S) bool. K and V are read once per KV head
    rather than repeated per query head; the softmax runs in fp32.
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, D)  # row g * T + t is query head (kv * G + g) at time t
    scores = torch.matmul(qg, k.to(q.dtype).transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask.repeat(G, 1), float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(p, v.to(q.dtype))
    return out.view(B, Hkv, G, T, D).reshape(B, H, T, D)


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One query per row as broadcast products and sums, in fp32, which Inductor compiles into
    a few fused loops (no matmul or SDPA call: at one query, their per-call cost on a CPU is
    larger than the work). q (B, H, 1, D), k/v (B, Hkv, S, D), mask (1, S) bool."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, 1, D).float()
    scores = (qg * k[:, :, None].float()).sum(-1) * scale  # (B, Hkv, G, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = (p[..., None] * v[:, :, None].float()).sum(-2)  # (B, Hkv, G, D)
    return out.reshape(B, H, 1, D).to(q.dtype)
