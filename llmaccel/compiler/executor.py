"""Reference executor: runs the IR with the reference ops and a contiguous KV cache.

It is the oracle that the paged runtime and the lowered kernels are tested against.
"""
from __future__ import annotations

from typing import Iterator

import torch

from llmaccel.ops.attention import ContiguousKVCache
from llmaccel.ops.kvquant import QuantizedKVCache, kv_quant_attention
from llmaccel.ops.sla import LinearAttentionCache, linear_attention
from llmaccel.sampling import SamplingParams, request_seed, sample


def kv_quant_specs(gm: torch.fx.GraphModule) -> dict[int, dict]:
    """layer -> KV-cache quantization spec, for the attention nodes that carry one."""
    return {n.kwargs["layer"]: dict(n.kwargs["kv_quant"]) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is kv_quant_attention}


def make_cache(gm: torch.fx.GraphModule, batch: int, max_len: int, dtype: torch.dtype, device="cpu"):
    """The attention context this graph needs: quantized if its attention nodes say so."""
    if any(n.op == "call_function" and n.target is linear_attention for n in gm.graph.nodes):
        return LinearAttentionCache(batch, max_len, dtype, device)  # sla: recurrent state, no KV
    specs = kv_quant_specs(gm)
    if specs:
        return QuantizedKVCache(batch, max_len, dtype, device, specs)
    return ContiguousKVCache(batch, max_len, dtype, device)


@torch.no_grad()
def forward(gm: torch.fx.GraphModule, ids: torch.Tensor, start: int = 0, ctx=None) -> torch.Tensor:
    """Logits (B, T, V) for ids (B, T) at positions start .. start + T - 1."""
    T = ids.shape[1]
    pos = torch.arange(start, start + T, device=ids.device).expand(ids.shape[0], T)
    out = gm(ids, pos, ctx)
    if ctx is not None:
        ctx.advance(T)
    return out


@torch.no_grad()
def generate_ids(model, prompt: list[int], params: SamplingParams) -> Iterator[int]:
    """Yield generated token ids one by one: one prefill, then one decode step per token.

    model: anything with `config` (eos_ids, max_position), `new_cache(batch, max_len)` and
    `logits(ids, start, cache)`: a Model (this executor) or an exported folder (onnxruntime)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    n = min(params.max_tokens, model.config.max_position - len(prompt))
    if n <= 0:
        return
    cache = model.new_cache(1, len(prompt) + n)
    seed = request_seed(params)
    logits = model.logits(torch.tensor([prompt]), 0, cache)[:, -1]
    for i in range(n):
        tok = int(sample(logits, params, seed, len(prompt) + i)[0])
        yield tok
        if tok in model.config.eos_ids and not params.ignore_eos:
            return
        if i + 1 < n:
            logits = model.logits(torch.tensor([[tok]]), cache.length, cache)[:, -1]
