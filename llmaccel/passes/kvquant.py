"""kvquant: KV-cache quantization. bits=8: int8 rows; bits=4 or 2: KIVI (keys per channel,
values per token, recent tokens exact).

bits=8 keeps every `attention` node and marks it kv_dtype="int8" (ops/kv_int8.py: int8 codes,
an fp16 scale per token and KV head, no calibration); the paged cache then holds codes, on the
decode runner as a cache of the model's dtype (CUDA graphs, prefix caching, speculative
decoding). bits=4/2 rewrite every `attention` node into `kv_quant_attention` carrying the KIVI
spec as its `kv_quant` kwarg. Weights are untouched. The spec takes effect in the attention context
(llmaccel.compiler.executor.make_cache builds a QuantizedKVCache from it): a whole-sequence
forward with no cache is unchanged, so quality is measured through the cache with chunked
prefill (`llmc eval` does this automatically for such graphs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.ops.kv_int8 import row_bytes
from llmaccel.ops.kvquant import bytes_per_token, kv_quant_attention, make_spec
from llmaccel.passes.base import Pass, PassContext, PassResult
from llmaccel.ir import op_nodes


@dataclass
class KVQuantConfig:
    bits: Literal[8, 4, 2] = 4
    # keys: tokens per (scale, min) group; values: channels per group (at most head_dim).
    # 0 = by bits: 32 at 4 bits; 16 at 2 bits, where 32 costs SmolLM2-135M +14% ppl and 16
    # about half that, at fewer bytes than keeping 32 and narrowing the value groups.
    group: int = 0
    residual: int = 128   # most recent tokens kept in full precision; a multiple of group

    def __post_init__(self):
        if self.bits not in (2, 4, 8):
            raise LlmaccelError(f"kvquant.bits must be 8, 4 or 2, got {self.bits}")
        if self.bits == 8:  # int8 rows: group and residual are KIVI's
            return
        if self.group == 0:
            self.group = 32 if self.bits == 4 else 16
        if self.group < 1:
            raise LlmaccelError(f"kvquant.group must be positive, got {self.group}")
        if self.residual < 0 or self.residual % self.group:
            raise LlmaccelError(f"kvquant.residual ({self.residual}) must be a non-negative "
                                f"multiple of kvquant.group ({self.group})")


class KVQuant(Pass):
    name = "kvquant"
    summary = "KV cache: int8 rows (bits=8), or KIVI 4/2-bit (keys per channel, values per token, recent tokens exact)"
    exact = False
    config_cls = KVQuantConfig

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        nodes = op_nodes(gm, ops.attention, kv_quant_attention)
        if not nodes:
            raise LlmaccelError("kvquant: the graph has no attention node to quantize")
        if c.bits == 8:
            return self._int8(gm, nodes)
        if any(n.kwargs.get("kv_dtype") is not None for n in nodes):
            raise LlmaccelError("kvquant: this graph's cache is int8-quantized already (kvquant.bits=8)")
        per_token, bf16 = 0.0, 0
        for n in nodes:
            kw = dict(n.kwargs)
            spec = make_spec(c.bits, c.group, c.residual, kw["head_dim"], where=f"layer {kw['layer']}")
            kw["kv_quant"] = spec
            n.target = kv_quant_attention
            n.kwargs = kw
            per_token += bytes_per_token(spec, kw["n_kv_heads"], kw["head_dim"])
            bf16 += 2 * kw["n_kv_heads"] * kw["head_dim"] * 2
        stats = {"layers": len(nodes), "bits": c.bits, "group": c.group, "residual": c.residual,
                 "value_group": spec["value_group"],
                 "kv_bytes_per_token": round(per_token, 1), "bf16_bytes_per_token": bf16,
                 "compression": round(bf16 / per_token, 2)}
        return PassResult(gm, len(nodes), stats)

    @staticmethod
    def _int8(gm, nodes) -> PassResult:
        if any(n.target is not ops.attention for n in nodes):
            raise LlmaccelError("kvquant: this graph's cache is KIVI-quantized already")
        per_token = 0
        for n in nodes:
            n.kwargs = {**n.kwargs, "kv_dtype": "int8"}
            per_token += row_bytes(n.kwargs["n_kv_heads"], n.kwargs["head_dim"])
        bf16 = sum(4 * n.kwargs["n_kv_heads"] * n.kwargs["head_dim"] for n in nodes)
        stats = {"layers": len(nodes), "bits": 8, "format": "int8, a fp16 scale per token and KV head",
                 "kv_bytes_per_token": per_token, "bf16_bytes_per_token": bf16,
                 "compression": round(bf16 / per_token, 2)}
        gm.recompile()
        return PassResult(gm, len(nodes), stats)


PASS = KVQuant
