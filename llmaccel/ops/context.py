"""The contract between the IR's stateful ops and the context a forward is given.

Every context a graph runs with (the reference executor's caches, ops/attention.py,
ops/kvquant.py, ops/sla.py; the runtime's step contexts, runtime/) subclasses `StepContext`
and overrides what it holds. The ops call these methods directly: a context that lacks a kind
of state says so in one line (the base methods), instead of the op probing it attribute by
attribute. A forward with no context at all (ctx None: whole sequences, training) never
reaches them.
"""
from __future__ import annotations

import torch

from llmaccel.errors import LlmaccelError

HINT = "build the context with llmaccel.compiler.executor.make_cache"


class StepContext:
    # the token rows whose logits the step samples (runtime/graph.select_rows); None: all rows
    logits_indices: torch.Tensor | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, *,
               n_heads: int, n_kv_heads: int, head_dim: int, scale: float, **kw) -> torch.Tensor:
        """Store this layer's k and v and attend q over everything held for the layer. `rope`,
        when given, is (cos, sin, positions) of a graph whose RoPE was folded into the attention
        (codegen/rope.py)."""
        raise LlmaccelError(f"layer {layer} is softmax attention and this context "
                            f"({type(self).__name__}) holds no KV cache; {HINT}")

    def kv_quant_spec(self, layer: int) -> dict | None:
        """How this context quantizes the layer's KV cache (KIVI), None: it does not."""
        return None

    def linear_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      conv_weight: torch.Tensor, **kw) -> torch.Tensor:
        """Advance this layer's recurrent state (sla) over q, k, v and return its outputs."""
        raise LlmaccelError(f"layer {layer} is linear attention (sla) and needs a recurrent-state "
                            f"context, not a KV cache; {HINT}")


__all__ = ["StepContext"]
