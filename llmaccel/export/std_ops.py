"""Translations of IR ops into the standard ONNX opset (21), one function per op.

Each translation computes what the op's reference in llmaccel/ops computes, in the same
dtypes: norms in fp32 and cast back, RoPE tables from the op's own kwargs, attention causal
over the KV cache inputs of its layer. A translation gets the Env (builder, graph inputs,
shared tables), the fx node, and its arguments with fx nodes replaced by ONNX value names,
`Weight`s (get_attr) or lists (tuple outputs).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import TensorProto

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.export.builder import GraphBuilder
from llmaccel.ops import bitlinear, quant, repbn, sparse
from llmaccel.ops.quant import unpack_int4
from llmaccel.ops.rope import rope_inv_freq

F32 = TensorProto.FLOAT


@dataclass
class Weight:
    """A graph weight (get_attr), converted and written only when a translation uses it."""
    name: str
    tensor: torch.Tensor


@dataclass
class Env:
    b: GraphBuilder
    input_ids: str
    positions: str
    attention_mask: str
    config: object
    fmt: str
    max_len: int
    # layer -> (past key, past value) input names, filled by the exporter
    past: dict = field(default_factory=dict)
    presents: dict = field(default_factory=dict)
    shared_weights: set = field(default_factory=set)
    absorbed: set = field(default_factory=set)      # genai: rope nodes done inside attention
    in_features: dict = field(default_factory=dict)  # genai: K of each linear_int4 node


def float_weight(env: Env, w: Weight, *, transpose: bool = False) -> str:
    """A floating-point weight in the compute dtype, (K, N) for MatMul when transposed."""
    suffix = ".T" if transpose else ""

    def make():
        t = w.tensor.detach().to(env.b.dtype)
        return t.t().contiguous() if transpose else t
    return env.b.weight(w.name + suffix, make)


def opt_float(env: Env, w) -> str | None:
    return None if w is None else float_weight(env, w)


# --- elementwise and glue -------------------------------------------------------------------

def t_add(env, node, a, b_):
    return env.b.op("Add", [a, b_])


def t_getitem(env, node, seq, i):
    return seq[i]


def t_split(env, node, x, sizes, dim=-1):
    if isinstance(sizes, int):
        raise LlmaccelError("export: split by a chunk size is not supported; the IR splits by sizes")
    return env.b.op("Split", [x, env.b.const(list(sizes), np.int64, "split")], n_out=len(sizes), axis=dim)


def t_clamp(env, node, x, min=None, max=None):  # noqa: A002  (torch.clamp's names)
    """torch.clamp glue (repbn keeps the BN input in its calibrated range): max, then min."""
    b = env.b
    bound = lambda v: float_weight(env, v) if isinstance(v, Weight) else b.scalar(v)  # noqa: E731
    if min is not None:
        x = b.op("Max", [x, bound(min)])
    if max is not None:
        x = b.op("Min", [x, bound(max)])
    return x


def t_silu_mul(env, node, gate, up):
    b = env.b
    return b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])


def t_relu_mul(env, node, gate, up):
    return env.b.op("Mul", [env.b.op("Relu", [gate]), up])


def t_gelu(env, node, x, approximate="tanh"):
    return env.b.op("Gelu", [x], approximate=approximate)


def t_gelu_mul(env, node, gate, up, approximate="tanh"):
    return env.b.op("Mul", [t_gelu(env, node, gate, approximate), up])


def t_relu_glu(env, node, gate, up, kind="relu", shift=0.0):
    b = env.b
    g = b.op("Relu", [b.op("Sub", [gate, b.scalar(shift)]) if shift else gate])
    return b.op("Mul", [g, b.op("Relu", [up]) if kind == "drelu" else up])


# --- embedding, linear ----------------------------------------------------------------------

def t_embedding(env, node, ids, w):
    return env.b.op("Gather", [float_weight(env, w), ids], axis=0)


def _matmul_t(env, x, w: Weight):
    """x @ w.T: a weight also read elsewhere (a tied embedding) is stored once and read by Gemm
    with transB; any other is stored transposed for MatMul."""
    b = env.b
    if w.name not in env.shared_weights:
        return b.op("MatMul", [x, float_weight(env, w, transpose=True)])
    n, k = w.tensor.shape
    flat = b.op("Reshape", [x, b.const([-1, k], np.int64, "shape")])
    y = b.op("Gemm", [flat, float_weight(env, w)], transB=1)
    lead = b.op("Slice", [b.op("Shape", [x]), b.const([0], np.int64), b.const([-1], np.int64)])
    return b.op("Reshape", [y, b.op("Concat", [lead, b.const([n], np.int64)], axis=0)])


def _bias(env, y, bias):
    return y if bias is None else env.b.op("Add", [y, float_weight(env, bias)])


def t_linear(env, node, x, w, bias=None):
    return _bias(env, _matmul_t(env, x, w), bias)


def t_sparse_down(env, node, x, weight_t, bias=None, sparsity=0.0):
    # The weight is stored (F, D) already: a plain MatMul; ONNX Runtime skips no zeros.
    return _bias(env, env.b.op("MatMul", [x, float_weight(env, weight_t)]), bias)


def _sliced_matmul(env, x, w_nk: str, k_stored: int):
    """x @ w.T for a dequantized (N, K_stored) weight, read up to x's own K (padded groups)."""
    b = env.b
    wt = b.op("Transpose", [w_nk], perm=[1, 0])
    k = b.op("Slice", [b.op("Shape", [x]), b.const([-1], np.int64), b.const([2 ** 62], np.int64)])
    wt = b.op("Slice", [wt, b.const([0], np.int64), k, b.const([0], np.int64)])
    return b.op("MatMul", [x, wt])


def int4_dequantize_linear(env, qweight: Weight, scales: Weight, zeros: Weight, group_size: int) -> str:
    """The (N, G * group_size) weight as a blockwise DequantizeLinear of uint4 codes.

    qweight's bytes are already a uint4 (N, G * group_size) tensor in ONNX's packing (two per
    byte, first element in the low nibble), so they are written as they are. The zero points
    are repacked when G is odd: ours pad each row to whole bytes, ONNX packs the flat tensor.
    """
    b = env.b
    N, G, half = qweight.tensor.shape
    q = b.weight(qweight.name + ".u4", lambda: qweight.tensor, onnx_type=TensorProto.UINT4,
                 dims=(N, G * 2 * half))

    def zp():
        z = unpack_int4(zeros.tensor)[:, :G].reshape(-1)
        z = torch.cat([z, z.new_zeros(len(z) % 2)])
        return (z[0::2] | (z[1::2] << 4)).to(torch.uint8)
    z = b.weight(zeros.name + ".u4", zp, onnx_type=TensorProto.UINT4, dims=(N, G))
    s = float_weight(env, scales)
    return b.op("DequantizeLinear", [q, s, z], axis=1, block_size=group_size)


def t_linear_int4(env, node, x, qweight, scales, zeros, bias=None, *, group_size):
    w = int4_dequantize_linear(env, qweight, scales, zeros, group_size)
    return _bias(env, _sliced_matmul(env, x, w, qweight.tensor.shape[1] * group_size), bias)


def t_linear_int8(env, node, x, qweight, scales, bias=None):
    """Cast x scale rather than DequantizeLinear: ONNX Runtime rewrites DequantizeLinear +
    MatMul into a kernel that also quantizes the activations (0.08 off on tiny-llama's
    logits), which the reference does not do. Both constants fold at session start."""
    b = env.b
    q = b.to_compute(b.weight(qweight.name, lambda: qweight.tensor), TensorProto.INT8)
    s = b.weight(scales.name + ".col", lambda: scales.tensor.detach().to(b.dtype)[:, None].contiguous())
    w = b.op("Mul", [q, s])
    return _bias(env, b.op("MatMul", [x, b.op("Transpose", [w], perm=[1, 0])]), bias)


def t_linear_w8a8(env, node, x, qweight, scales, smooth, bias=None):
    """The reference in fp32 standard ops: x * smooth rounded per row (Round is half to even, as
    torch.round) times absmax / 127, then a MatMul with the dequantized int8 weight."""
    b = env.b
    h = b.op("Mul", [x if b.onnx_dtype == F32 else b.cast(x, F32),
                     b.weight(smooth.name + ".f32", lambda: smooth.tensor.float())])
    amax = b.op("ReduceMax", [b.op("Abs", [h]), b.const([-1], np.int64, "axes")], keepdims=1)
    s = b.op("Div", [b.op("Max", [amax, b.const(np.float32(np.finfo(np.float32).tiny))]),
                     b.const(np.float32(127.0))])
    w = b.weight(qweight.name + ".w8a8_t", lambda: quant.dequantize_int8(
        qweight.tensor, scales.tensor, torch.float32).t().contiguous())
    y = b.op("MatMul", [b.op("Mul", [b.op("Round", [b.op("Div", [h, s])]), s]), w])
    if bias is not None:
        y = b.op("Add", [y, b.weight(bias.name + ".f32", lambda: bias.tensor.float())])
    return b.to_compute(y, F32)


def t_bitlinear(env, node, x, w_packed, w_scale, bias=None, *, in_features, out_features):
    """BitNet b1.58 in standard ops, as the reference computes it in fp32: per-token absmax
    int8 activation codes (Round is half to even, as torch.round), an exact integer-valued
    MatMul with the ternary codes, then / inv * scale. Cost: the codes are stored unpacked as
    int8 (4x the 2-bit packing) and ONNX Runtime folds their Cast into an fp32 weight."""
    b = env.b
    h = x if b.onnx_dtype == F32 else b.cast(x, F32)
    amax = b.op("Max", [b.op("ReduceMax", [b.op("Abs", [h]), b.const([-1], np.int64, "axes")], keepdims=1),
                        b.const(np.float32(1e-5))])
    inv = b.op("Div", [b.const(np.float32(127.0)), amax])
    q = b.op("Clip", [b.op("Round", [b.op("Mul", [h, inv])]), b.const(np.float32(-128)), b.const(np.float32(127))])
    codes = b.weight(w_packed.name + ".ternary_t", lambda: bitlinear.unpack_ternary(
        w_packed.tensor, in_features).t().contiguous())
    acc = b.op("MatMul", [q, b.cast(codes, F32)])
    y = b.op("Mul", [b.op("Div", [acc, inv]), b.weight(w_scale.name + ".f32", lambda: w_scale.tensor.float())])
    if bias is not None:
        y = b.op("Add", [y, b.weight(bias.name + ".f32", lambda: bias.tensor.float())])
    return b.to_compute(y, F32)


def t_rms_norm_bitlinear(env, node, x, norm_weight, w_packed, w_scale, bias=None, *, eps,
                         in_features, out_features):
    h = t_rms_norm(env, node, x, norm_weight, eps=eps)
    return t_bitlinear(env, node, h, w_packed, w_scale, bias, in_features=in_features,
                       out_features=out_features)


# --- norms ----------------------------------------------------------------------------------

def rms_normalize(env, x: str, eps: float) -> str:
    """x * rsqrt(mean(x^2) + eps) in fp32, cast back to the compute dtype (no scale)."""
    b = env.b
    h = x if b.onnx_dtype == F32 else b.cast(x, F32)
    ms = b.op("ReduceMean", [b.op("Mul", [h, h]), b.const([-1], np.int64, "axes")], keepdims=1)
    r = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [ms, b.const(np.float32(eps))])])])
    h = b.op("Mul", [h, r])
    return b.to_compute(h, F32)


def t_rms_norm(env, node, x, w, *, eps):
    h = rms_normalize(env, x, eps)
    return h if w is None else env.b.op("Mul", [float_weight(env, w), h])


def ones_last(env, x: str) -> str:
    """Ones of x's last dimension, for norm ops whose scale input is required."""
    b = env.b
    d = b.op("Slice", [b.op("Shape", [x]), b.const([-1], np.int64), b.const([2 ** 62], np.int64)])
    return b.op("ConstantOfShape", [d], value=onnx.helper.make_tensor("one", b.onnx_dtype, [1], [1]))


def t_layer_norm(env, node, x, w, bias, *, eps):
    b = env.b
    scale = ones_last(env, x) if w is None else float_weight(env, w)  # the op needs a scale
    return b.op("LayerNormalization", [x, scale, opt_float(env, bias)],
                axis=-1, epsilon=float(eps))


def t_add_rms_norm(env, node, x, residual, w, *, eps):
    s = env.b.op("Add", [x, residual])
    return [t_rms_norm(env, node, s, w, eps=eps), s]


def t_add_layer_norm(env, node, x, residual, w, bias, *, eps):
    s = env.b.op("Add", [x, residual])
    return [t_layer_norm(env, node, s, w, bias, eps=eps), s]


def t_batch_norm(env, node, x, mean, var, w, bias, *, eps):
    b = env.b
    h = x if b.onnx_dtype == F32 else b.cast(x, F32)
    f = lambda t: b.weight(t.name + ".f32", lambda: t.tensor.float())  # noqa: E731
    h = b.op("Mul", [b.op("Sub", [h, f(mean)]),
                     b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [f(var), b.const(np.float32(eps))])])])])
    if w is not None:
        h = b.op("Mul", [h, f(w)])
    if bias is not None:
        h = b.op("Add", [h, f(bias)])
    return b.to_compute(h, F32)


def t_norm_affine(env, node, x, scale, shift):
    b = env.b
    h = x if b.onnx_dtype == F32 else b.cast(x, F32)
    f = lambda t: b.weight(t.name + ".f32", lambda: t.tensor.float())  # noqa: E731
    return b.to_compute(b.op("Add", [b.op("Mul", [h, f(scale)]), f(shift)]), F32)


# --- rope and attention ---------------------------------------------------------------------

def inv_freq(head_dim, theta, scaling) -> np.ndarray:
    return rope_inv_freq(head_dim, theta, scaling).numpy().astype(np.float32)


def rope_tables(env, positions: str, head_dim: int, theta: float, scaling) -> tuple[str, str]:
    """cos, sin of shape (B, T, 1, head_dim) in the compute dtype, built once per frequency set."""
    def make():
        b = env.b
        freqs = b.op("Mul", [b.op("Unsqueeze", [b.cast(positions, F32), b.const([-1], np.int64)]),
                             b.const(inv_freq(head_dim, theta, scaling), name="inv_freq")])
        emb = b.op("Concat", [freqs, freqs], axis=-1)
        return tuple(b.op("Unsqueeze", [b.to_compute(b.op(f, [emb]), F32), b.const([2], np.int64)])
                     for f in ("Cos", "Sin"))
    return env.b.memo(("rope", positions, head_dim, theta, repr(scaling)), make)


def t_rope(env, node, x, positions, *, head_dim, theta, scaling=None):
    b = env.b
    cos, sin = rope_tables(env, positions, head_dim, theta, scaling)
    h = b.op("Reshape", [x, b.const([0, 0, -1, head_dim], np.int64, "shape")])
    x1, x2 = b.op("Split", [h], n_out=2, axis=-1, num_outputs=2)
    rot = b.op("Concat", [b.op("Neg", [x2]), x1], axis=-1)
    out = b.op("Add", [b.op("Mul", [h, cos]), b.op("Mul", [rot, sin])])
    return b.op("Reshape", [out, b.const([0, 0, -1], np.int64, "shape")])


def causal_keep(env) -> str:
    """(B, 1, 1, T, S) bool: query t (absolute S - T + t) sees key j <= it where the mask is 1."""
    def make():
        b = env.b
        i64 = lambda v: b.const(v, np.int64)  # noqa: E731
        S = b.op("Gather", [b.op("Shape", [env.attention_mask]), i64(1)], axis=0)
        T = b.op("Gather", [b.op("Shape", [env.input_ids]), i64(1)], axis=0)
        kpos = b.op("Range", [i64(0), S, i64(1)])
        qpos = b.op("Range", [b.op("Sub", [S, T]), S, i64(1)])
        causal = b.op("LessOrEqual", [b.op("Unsqueeze", [kpos, i64([0])]), b.op("Unsqueeze", [qpos, i64([1])])])
        pad = b.op("Cast", [b.op("Unsqueeze", [env.attention_mask, i64([1, 2, 3])])], to=TensorProto.BOOL)
        return b.op("And", [causal, pad])
    return env.b.memo("causal_keep", make)


def kv_heads(env, x, n: int, d: int) -> str:
    """(B, T, n * d) -> (B, n, T, d)."""
    b = env.b
    return b.op("Transpose", [b.op("Reshape", [x, b.const([0, 0, n, d], np.int64, "shape")])], perm=[0, 2, 1, 3])


def t_attention(env, node, q, k, v, ctx, *, layer, n_heads, n_kv_heads, head_dim, scale):
    """Softmax attention over past ++ new keys, GQA by broadcasting q's head groups."""
    b = env.b
    past_k, past_v = env.past[layer]
    k_all = b.op("Concat", [past_k, kv_heads(env, k, n_kv_heads, head_dim)], axis=2,
                 outputs=[f"present.{layer}.key"])
    v_all = b.op("Concat", [past_v, kv_heads(env, v, n_kv_heads, head_dim)], axis=2,
                 outputs=[f"present.{layer}.value"])
    env.presents[layer] = (k_all, v_all)
    g = n_heads // n_kv_heads
    i64 = lambda v_: b.const(v_, np.int64, "shape")  # noqa: E731
    # q (B, T, H*D) -> (B, Hkv, g, T, D); keys (B, Hkv, 1, D, S); values (B, Hkv, 1, S, D)
    qh = b.op("Transpose", [b.op("Reshape", [q, i64([0, 0, n_kv_heads, g, head_dim])])], perm=[0, 2, 3, 1, 4])
    kt = b.op("Unsqueeze", [b.op("Transpose", [k_all], perm=[0, 1, 3, 2]), b.const([2], np.int64)])
    vh = b.op("Unsqueeze", [v_all, b.const([2], np.int64)])
    scores = b.op("Mul", [b.op("MatMul", [qh, kt]), b.scalar(scale)])
    low = b.scalar(float(np.finfo(np.float32 if b.onnx_dtype == F32 else np.float16).min))
    scores = b.op("Where", [causal_keep(env), scores, low])
    # softmax in fp32 as the reference's SDPA accumulates it; a masked-out row stays finite
    p = b.to_compute(b.op("Softmax", [scores if b.onnx_dtype == F32 else b.cast(scores, F32)], axis=-1), F32)
    out = b.op("MatMul", [p, vh])                                   # (B, Hkv, g, T, D)
    out = b.op("Transpose", [out], perm=[0, 3, 1, 2, 4])           # (B, T, Hkv, g, D)
    return b.op("Reshape", [out, i64([0, 0, n_heads * head_dim])])


def t_lm_head(env, node, x, w, bias=None):
    return t_linear(env, node, x, w, bias)


TRANSLATIONS = {
    ops.embedding: t_embedding, ops.linear: t_linear, ops.rms_norm: t_rms_norm,
    ops.layer_norm: t_layer_norm, ops.add_rms_norm: t_add_rms_norm,
    ops.add_layer_norm: t_add_layer_norm, ops.rope: t_rope, ops.attention: t_attention,
    ops.silu_mul: t_silu_mul, ops.gelu_mul: t_gelu_mul, ops.relu_mul: t_relu_mul, ops.gelu: t_gelu,
    ops.lm_head: t_lm_head, quant.linear_int4: t_linear_int4, quant.linear_int8: t_linear_int8,
    quant.linear_w8a8: t_linear_w8a8,
    sparse.sparse_down: t_sparse_down, sparse.relu_glu: t_relu_glu,
    bitlinear.bitlinear: t_bitlinear, bitlinear.rms_norm_bitlinear: t_rms_norm_bitlinear,
    repbn.batch_norm: t_batch_norm, repbn.norm_affine: t_norm_affine,
    operator.add: t_add, torch.clamp: t_clamp, operator.getitem: t_getitem, "split": t_split,
}
