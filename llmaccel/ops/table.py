"""The op table: every IR op, what it is and where its other forms live.

An IR node is a call_function on one of these references; everything that needs to know about
ops (op counts, lowering, artifact loading, export, passes that look for a kind of op) asks this
table instead of matching module paths or names.

    name      the op's name: the reference function's, the custom op's (torch.ops.llmaccel.<name>)
              when it has a kernel, the key of stats and reports
    ref       the pure-PyTorch reference: the IR node's target
    kind      embedding | linear | norm | norm_linear | rope | attention | activation | head |
              collective
    made_by   the pass that puts it in a graph (None: capture)
    kernel    the module of llmaccel.kernels that registers torch.ops.llmaccel.<name> with the
              reference's schema, or None (lowering retargets any op without a context to a
              custom op of its name in the namespace it is given, when one is registered; rope is
              lowered to tables first, codegen/lower.py, whose eager form is kernels/pointwise.py;
              attention ops go through the runtime's contexts: runtime/kv_cache.py and
              runtime/decode.py call kernels/paged_attention.py and paged_rope.py, the KIVI
              cache kernels/paged_kivi.py)
    context   takes an attention context as its fourth argument (a subclass of ops/context.StepContext)
    eager_only  its custom op is taken only by graphs run uncompiled (lower(select="eager"): the
              engine's prefill and mixed steps); a compiled step keeps the reference, which
              Inductor fuses with its neighbours and the GEMV rewrites read

Export to ONNX (export/): an op's translation is `t_<name>` in export/std_ops.py, overridden
by `g_<name>` in export/genai_ops.py where the GenAI format has a contrib op for it; an op with
none is refused with the reason export/refusals.py gives (tests/export checks both rules).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from llmaccel import ops
from llmaccel.ops import bitlinear as bl
from llmaccel.ops import collective, kvquant, quant, repbn, sla, sparse


@dataclass(frozen=True)
class OpSpec:
    ref: Callable
    kind: str
    made_by: str | None = None
    kernel: str | None = None
    context: bool = False
    eager_only: bool = False

    @property
    def name(self) -> str:
        return self.ref.__name__

    @property
    def qualname(self) -> str:
        """How an artifact's graph names the op (module and function)."""
        return f"{self.ref.__module__}.{self.ref.__name__}"


_SPECS = [
    OpSpec(ops.embedding, "embedding"),
    OpSpec(ops.linear, "linear"),
    OpSpec(ops.rms_norm, "norm", kernel="norm", eager_only=True),
    OpSpec(ops.layer_norm, "norm"),
    OpSpec(ops.add_rms_norm, "norm", made_by="fuse", kernel="norm", eager_only=True),
    OpSpec(ops.add_layer_norm, "norm", made_by="fuse"),
    OpSpec(ops.rope, "rope"),
    OpSpec(ops.attention, "attention", context=True),
    OpSpec(ops.silu_mul, "activation", kernel="pointwise", eager_only=True),
    OpSpec(ops.gelu_mul, "activation"),
    OpSpec(ops.relu_mul, "activation", made_by="relu"),
    OpSpec(ops.gelu, "activation"),
    OpSpec(ops.lm_head, "head"),
    OpSpec(quant.linear_int8, "linear", made_by="quant", kernel="quant_linear_int8"),
    # no custom op: CPU graphs take its CPU form (quant_linear_int8.CPU_FORMS), GPU graphs the
    # reference (no W8A8 GPU kernel yet)
    OpSpec(quant.linear_w8a8, "linear", made_by="quant"),
    OpSpec(quant.linear_int4, "linear", made_by="quant", kernel="quant_linear"),
    OpSpec(kvquant.kv_quant_attention, "attention", made_by="kvquant", context=True),
    OpSpec(bl.bitlinear, "linear", made_by="bitlinear", kernel="bitlinear"),
    OpSpec(bl.rms_norm_bitlinear, "norm_linear", made_by="bitlinear", kernel="bitlinear"),
    OpSpec(bl.bitlinear_train, "linear", made_by="bitlinear"),
    OpSpec(bl.rms_norm_bitlinear_train, "norm_linear", made_by="bitlinear"),
    OpSpec(repbn.batch_norm, "norm", made_by="repbn"),
    OpSpec(repbn.norm_affine, "norm", made_by="repbn"),
    OpSpec(repbn.repbn_blend, "norm", made_by="repbn"),
    # its kernel (llmaccel::linear_attention) is the whole-sequence form, without a context
    OpSpec(sla.linear_attention, "attention", made_by="sla", context=True),
    OpSpec(sparse.sparse_down, "linear", made_by="relu", kernel="sparse_down"),
    OpSpec(sparse.relu_glu, "activation", made_by="relu"),
    OpSpec(sparse.relu_glu_held, "activation", made_by="relu"),
    # made by the tensor-parallel sharding at load (llmaccel/parallel/tp.py), never by a pass
    OpSpec(collective.all_reduce, "collective"),
]

OPS: dict[str, OpSpec] = {s.name: s for s in _SPECS}
_BY_REF: dict[Callable, OpSpec] = {s.ref: s for s in _SPECS}
_BY_QUALNAME: dict[str, OpSpec] = {s.qualname: s for s in _SPECS}


def spec_of(target) -> OpSpec | None:
    """The table's entry for a graph target (None: not an IR op, e.g. operator.getitem)."""
    try:
        return _BY_REF.get(target)
    except TypeError:  # an unhashable target is no IR op
        return None


def by_qualname(qualname: str) -> OpSpec | None:
    return _BY_QUALNAME.get(qualname)
