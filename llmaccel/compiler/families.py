"""Canonical model definitions, written only with llmaccel.ops, and their capture into the IR.

Each family declares its weights (`weight_shapes`) and a forward that fx traces into a graph of
op nodes whose weights are get_attr nodes. Weight names are the IR's own
(`layers.3.q.weight`), not any checkpoint's.
"""
from __future__ import annotations

import math

import torch
import torch.fx
import torch.nn as nn

from llmaccel import ops
from llmaccel.ir import set_weight
from llmaccel.config import ModelConfig
from llmaccel.errors import LlmaccelError
from llmaccel.ops.rope import rope_inv_freq


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of the canonical model, by IR name."""
    D, H, Hkv, hd, F_ = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
    s: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, D)}
    gpt2 = cfg.family == "gpt2"
    if gpt2:
        s["pos_embed.weight"] = (cfg.max_position, D)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        s[p + "attn_norm.weight"] = (D,)
        s[p + "mlp_norm.weight"] = (D,)
        for n, out in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * hd)):
            s[p + n + ".weight"] = (out, D)
            if cfg.attention_bias or gpt2:
                s[p + n + ".bias"] = (out,)
        s[p + "o.weight"] = (D, H * hd)
        if gpt2:
            s.update({p + "attn_norm.bias": (D,), p + "mlp_norm.bias": (D,), p + "o.bias": (D,),
                      p + "fc.weight": (F_, D), p + "fc.bias": (F_,),
                      p + "proj.weight": (D, F_), p + "proj.bias": (D,)})
        else:
            if cfg.o_bias:
                s[p + "o.bias"] = (D,)
            for n, shape in (("gate", (F_, D)), ("up", (F_, D)), ("down", (D, F_))):
                s[p + n + ".weight"] = shape
                if cfg.mlp_bias:
                    s[p + n + ".bias"] = (shape[0],)
    s["norm.weight"] = (D,)
    if gpt2:
        s["norm.bias"] = (D,)
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, D)
    return s


def _get(m: nn.Module, name: str):
    mod = m
    for part in name.split("."):
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod


class _Canonical(nn.Module):
    """Holds weights under IR names; subclasses write forward with llmaccel.ops only."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        missing = set(weight_shapes(cfg)) - set(weights)
        if missing:
            raise LlmaccelError(f"weights missing for {cfg.family}: {sorted(missing)[:5]}")
        for name, w in weights.items():
            set_weight(self, name, w)

    def w(self, name: str):
        return _get(self, name)

    def attn(self, h, positions, ctx, i: int):
        c, p = self.cfg, f"layers.{i}."
        q = ops.linear(h, self.w(p + "q.weight"), self.w(p + "q.bias"))
        k = ops.linear(h, self.w(p + "k.weight"), self.w(p + "k.bias"))
        v = ops.linear(h, self.w(p + "v.weight"), self.w(p + "v.bias"))
        if c.family == "llama":
            rk = dict(head_dim=c.head_dim, theta=c.rope_theta, scaling=c.rope_scaling)
            q = ops.rope(q, positions, **rk)
            k = ops.rope(k, positions, **rk)
        a = ops.attention(q, k, v, ctx, layer=i, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                          head_dim=c.head_dim, scale=1.0 / math.sqrt(c.head_dim))
        return ops.linear(a, self.w(p + "o.weight"), self.w(p + "o.bias"))

    def head(self, x):
        name = "embed.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        return ops.lm_head(x, self.w(name))


class LlamaModel(_Canonical):
    """Llama, Mistral, Qwen2, SmolLM: RMSNorm, RoPE, GQA, SwiGLU."""

    def __init__(self, cfg, weights):
        super().__init__(cfg, weights)
        rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # reject unknown scaling now

    def forward(self, input_ids, positions, ctx=None):
        c = self.cfg
        x = ops.embedding(input_ids, self.w("embed.weight"))
        for i in range(c.n_layers):
            p = f"layers.{i}."
            x = x + self.attn(ops.rms_norm(x, self.w(p + "attn_norm.weight"), eps=c.norm_eps),
                              positions, ctx, i)
            h = ops.rms_norm(x, self.w(p + "mlp_norm.weight"), eps=c.norm_eps)
            g = ops.linear(h, self.w(p + "gate.weight"), self.w(p + "gate.bias"))
            u = ops.linear(h, self.w(p + "up.weight"), self.w(p + "up.bias"))
            x = x + ops.linear(ops.silu_mul(g, u), self.w(p + "down.weight"), self.w(p + "down.bias"))
        return self.head(ops.rms_norm(x, self.w("norm.weight"), eps=c.norm_eps))


class GPT2Model(_Canonical):
    """GPT-2: LayerNorm, learned positions, MHA, GELU MLP."""

    def forward(self, input_ids, positions, ctx=None):
        c = self.cfg
        x = ops.embedding(input_ids, self.w("embed.weight")) + ops.embedding(positions, self.w("pos_embed.weight"))
        for i in range(c.n_layers):
            p = f"layers.{i}."
            h = ops.layer_norm(x, self.w(p + "attn_norm.weight"), self.w(p + "attn_norm.bias"), eps=c.norm_eps)
            x = x + self.attn(h, positions, ctx, i)
            h = ops.layer_norm(x, self.w(p + "mlp_norm.weight"), self.w(p + "mlp_norm.bias"), eps=c.norm_eps)
            h = ops.gelu(ops.linear(h, self.w(p + "fc.weight"), self.w(p + "fc.bias")), approximate="tanh")
            x = x + ops.linear(h, self.w(p + "proj.weight"), self.w(p + "proj.bias"))
        return self.head(ops.layer_norm(x, self.w("norm.weight"), self.w("norm.bias"), eps=c.norm_eps))


FAMILY_MODELS = {"llama": LlamaModel, "gpt2": GPT2Model}


def capture(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.fx.GraphModule:
    """Build the canonical model of cfg.family and trace it into the IR."""
    root = FAMILY_MODELS[cfg.family](cfg, weights)
    graph = torch.fx.Tracer().trace(root)
    gm = torch.fx.GraphModule(root, graph, class_name=f"{cfg.family}_ir")
    gm.graph.lint()
    return gm
