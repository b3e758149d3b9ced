"""IR ops: each function is an fx leaf and its body is the op's reference semantics (the spec).

Structural facts travel as keyword arguments so that passes read them from the node and never
have to recognise an ATen pattern. References compute in the input dtype except where the
source models upcast (norms and softmax run in fp32, as HF does).
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel.ops.attention import causal_attention
from llmaccel.ops.rope import rope_at, rope_inv_freq

__all__ = [
    "embedding", "linear", "rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm", "rope",
    "attention", "silu_mul", "gelu_mul", "relu_mul", "gelu", "lm_head", "IR_OPS",
]


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, *, eps: float) -> torch.Tensor:
    # Normalise in fp32 and scale after casting back, exactly as Llama's RMSNorm does.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.to(x.dtype)
    return h if weight is None else weight * h


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, *,
               eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, *,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the norm that follows: returns (norm(x + residual), x + residual)."""
    s = x + residual
    return rms_norm(s, weight, eps=eps), s


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, *, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return layer_norm(s, weight, bias, eps=eps), s


def rope(x: torch.Tensor, positions: torch.Tensor, *, head_dim: int, theta: float,
         scaling: dict | None = None) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout, on x of shape (B, T, H * head_dim).

    Frequencies come from the structural kwargs (fp32, never stored in a lower precision).
    """
    return rope_at(x, positions, rope_inv_freq(head_dim, theta, scaling).to(x.device),
                   head_dim=head_dim)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx, *, layer: int, n_heads: int,
              n_kv_heads: int, head_dim: int, scale: float, kv_dtype: str | None = None) -> torch.Tensor:
    """Causal GQA attention on (B, T, H * head_dim) inputs.

    `ctx` binds the op to a KV cache at run time: None means a fresh causal prefill with no
    cache; otherwise the context stores k/v for `layer` and attends over everything it holds.
    kv_dtype: "int8", the layer's cache holds int8 codes with a scale per row (ops/kv_int8.py);
    None: the model's dtype.
    """
    if ctx is None:
        return causal_attention(q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                head_dim=head_dim, scale=scale)
    coded = {} if kv_dtype is None else {"kv_dtype": kv_dtype}  # only contexts that hold codes take it
    return ctx.attend(layer, q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=head_dim, scale=scale, **coded)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_mul(gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    return F.gelu(gate, approximate=approximate) * up


def relu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.relu(gate) * up


def gelu(x: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def lm_head(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


IR_OPS = {name: globals()[name] for name in __all__ if name != "IR_OPS"}
for _name in IR_OPS:
    torch.fx.wrap(_name)
