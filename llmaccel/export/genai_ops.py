"""Translations for `--format genai`: Microsoft contrib ops as ONNX Runtime GenAI's model
builder emits them, so its generate loop (shared past/present buffers) runs the folder.

- attention -> GroupQueryAttention (com.microsoft), with the RoPE of q and k inside it
  (do_rotary, cos/sin caches of the op's own frequencies) when both come from rope nodes;
  seqlens_k and total_sequence_length from attention_mask, as the builder computes them.
- add_rms_norm -> SkipSimplifiedLayerNormalization (outputs 0 and 3: the norm and the sum).
- linear_int4 -> MatMulNBits (bits=4): our qweight, scales and zeros are its B, scales and
  zero_points bit for bit (docs/quant-format.md).
Everything else keeps its standard translation (ONNX Runtime fuses the plain RMSNorm pattern).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.fx
from onnx import TensorProto

from llmaccel import ops
from llmaccel.export.std_ops import Env, float_weight, ones_last, t_rope
from llmaccel.ops import quant
from llmaccel.ops.rope import rope_inv_freq

MS = "com.microsoft"
# 0: MatMulNBits dequantizes to A's float type and multiplies in it (the llmaccel reference's
# arithmetic); 4 would quantize activations to int8 for speed at a small accuracy cost.
ACCURACY_LEVEL = 0


def _is_rope_of_positions(n, positions: torch.fx.Node) -> bool:
    return (isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target is ops.rope
            and n.args[1] is positions and len(n.users) == 1)


def absorbed_ropes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """rope nodes that GroupQueryAttention applies itself: q's and k's of one attention node,
    both at the graph's positions (GQA rotates at the cache position, which they equal)."""
    positions = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "positions")
    out: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is ops.attention:
            q, k = n.args[0], n.args[1]
            if (_is_rope_of_positions(q, positions) and _is_rope_of_positions(k, positions)
                    and q.kwargs == k.kwargs):
                out.update((q, k))
    return out


def in_features(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """K of each linear_int4 node (its input's last dimension, below the stored groups when
    padded), read by running the graph once on two tokens."""
    from torch.fx.passes.shape_prop import ShapeProp

    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is quant.linear_int4]
    if not nodes:
        return {}
    ids = torch.zeros(1, 2, dtype=torch.long)
    ShapeProp(gm).propagate(ids, torch.arange(2)[None], None)
    return {n: n.args[0].meta["tensor_meta"].shape[-1] for n in nodes}


def mask_lengths(env: Env) -> tuple[str, str]:
    """seqlens_k (B,) int32 = tokens per row - 1, and total_sequence_length () int32."""
    def make():
        b = env.b
        one = b.const([1], np.int64)
        s = b.op("Sub", [b.op("ReduceSum", [env.attention_mask, one], keepdims=0), b.const(1, np.int64)])
        total = b.op("Gather", [b.op("Shape", [env.attention_mask]), b.const(1, np.int64)], axis=0)
        return b.cast(s, TensorProto.INT32), b.cast(total, TensorProto.INT32)
    return env.b.memo("mask_lengths", make)


def rotary_caches(env: Env, head_dim: int, theta: float, scaling) -> tuple[str, str]:
    """cos, sin (max_position, head_dim / 2), from the same fp32 frequencies as the rope op."""
    def make():
        inv = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(env.max_len, dtype=torch.int64).float(), inv)
        key = f"rotary.{head_dim}.{theta}.{abs(hash(repr(scaling)))}"
        return (env.b.weight(key + ".cos", lambda: freqs.cos().to(env.b.dtype)),
                env.b.weight(key + ".sin", lambda: freqs.sin().to(env.b.dtype)))
    return env.b.memo(("rotary", head_dim, theta, repr(scaling)), make)


def g_rope(env, node, x, positions, *, head_dim, theta, scaling=None):
    if node in env.absorbed:
        return x  # GroupQueryAttention rotates it
    return t_rope(env, node, x, positions, head_dim=head_dim, theta=theta, scaling=scaling)


def g_attention(env, node, q, k, v, ctx, *, layer, n_heads, n_kv_heads, head_dim, scale):
    b = env.b
    seqlens, total = mask_lengths(env)
    rotary = node.args[0] in env.absorbed
    cos = sin = None
    if rotary:
        rk = node.args[0].kwargs
        cos, sin = rotary_caches(env, rk["head_dim"], rk["theta"], rk.get("scaling"))
    past_k, past_v = env.past[layer]
    out = b.op("GroupQueryAttention", [q, k, v, past_k, past_v, seqlens, total, cos, sin], n_out=3,
               domain=MS, name=f"layers.{layer}.GroupQueryAttention",
               outputs=[b.fresh(f"/layers.{layer}/attn/out"), f"present.{layer}.key", f"present.{layer}.value"],
               num_heads=n_heads, kv_num_heads=n_kv_heads, scale=float(scale), local_window_size=-1,
               softcap=0.0, do_rotary=int(rotary), rotary_interleaved=0)
    env.presents[layer] = (out[1], out[2])
    return out[0]


def g_add_rms_norm(env, node, x, residual, w, *, eps):
    b = env.b
    gamma = float_weight(env, w) if w is not None else ones_last(env, x)
    outs = [b.fresh("/SkipLayerNorm/out"), "", "", b.fresh("/SkipLayerNorm/sum")]
    b.op("SkipSimplifiedLayerNormalization", [x, residual, gamma], n_out=4, domain=MS,
         outputs=outs, epsilon=float(eps))
    return [outs[0], outs[3]]


def g_linear_int4(env, node, x, qweight, scales, zeros, bias=None, *, group_size):
    b = env.b
    N = qweight.tensor.shape[0]
    inputs = [x, b.weight(qweight.name, lambda: qweight.tensor), float_weight(env, scales),
              b.weight(zeros.name, lambda: zeros.tensor), None,
              None if bias is None else float_weight(env, bias)]
    return b.op("MatMulNBits", inputs, domain=MS, K=int(env.in_features[node]), N=int(N), bits=4,
                block_size=int(group_size), accuracy_level=ACCURACY_LEVEL)


GENAI_TRANSLATIONS = {ops.rope: g_rope, ops.attention: g_attention, ops.add_rms_norm: g_add_rms_norm,
                      quant.linear_int4: g_linear_int4}
