"""Why an IR op has no ONNX form: one line for the user, naming the op and what to do."""
from __future__ import annotations

from llmaccel.ops import bitlinear, collective, kvquant, repbn, sla, sparse

# Ops whose run-time semantics ONNX Runtime cannot express without a silent change: a plain
# attention in place of KIVI's quantized cache, or a softmax attention in place of SLA's
# recurrent state, would export a different model than the one compiled.
REFUSED = {
    kvquant.kv_quant_attention: "kvquant's KIVI cache is quantized inside our runtime; ONNX Runtime "
                                "keeps a plain KV cache. Export the graph compiled without kvquant",
    sla.linear_attention: "sla's recurrent linear-attention state has no ONNX Runtime form",
    bitlinear.bitlinear_train: "a training form (heal did not finish); export the inference graph",
    bitlinear.rms_norm_bitlinear_train: "a training form (heal did not finish); export the inference graph",
    repbn.repbn_blend: "a training form (heal did not finish); export the inference graph",
    sparse.relu_glu_held: "a training form (heal did not finish); export the inference graph",
    collective.all_reduce: "a tensor-parallel rank's graph; export the unsharded model",
}


# an attention node whose cache holds codes (kvquant.bits=8): ONNX Runtime's cache would not
KV_DTYPE = ("export: kvquant.bits=8 keeps the KV cache as int8 rows inside our runtime; ONNX Runtime "
            "keeps a plain KV cache. Export the graph compiled without kvquant")


def message(target, name: str) -> str:
    reason = REFUSED.get(target)
    line = f"export: the IR op {name!r} has no ONNX translation"
    return f"{line}: {reason}" if reason else line
