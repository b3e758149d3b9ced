"""RoPE folded into the attention of a lowered graph, for kernels that rotate q and k themselves.

`fuse_rope` rewrites attention(rope_table(q), rope_table(k), v) into attention_rope(q, k, v, ctx,
cos, sin, positions): the attention context receives q and k unrotated with the tables, and
where q, k, v are the three parts of one fused projection, the projection itself (k = v = None),
so a kernel reads it in place. The runtime's decode context passes them to
llmaccel::paged_rope_decode_attention (one launch per layer for RoPE, the KV write and the
attention); without a context the rotation happens here.
"""
from __future__ import annotations

import operator

import torch

from llmaccel import ops
from llmaccel.codegen.kernel_ops import retarget
from llmaccel.codegen.lower import rope_table


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
                   head_dim: int, scale: float, kv_dtype: str | None = None) -> torch.Tensor:
    """ops.attention with q and k before their rotary embedding (cos / sin tables by position);
    k = v = None: q is the fused projection (B, T, (H + 2 Hkv) D). A context takes the tables as
    they are (the runtime's decode kernel rotates at each row's position); without a
    context (a plain causal forward) q and k are rotated here."""
    if ctx is not None:
        coded = {} if kv_dtype is None else {"kv_dtype": kv_dtype}
        return ctx.attend(layer, q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                          scale=scale, rope=(cos, sin, positions), **coded)
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
        retarget(node, attention_rope)
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
