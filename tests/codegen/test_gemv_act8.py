"""Which int4 GEMVs round x to int8 (gemv_rewrites.int8_activations): those of bf16 / fp16
graphs, never an fp32 graph's (greedy identity with the reference executor)."""
import copy

import pytest
import torch

from llmaccel import compile
from llmaccel.codegen.lower import lower


@pytest.mark.parametrize("dtype,act8", [(torch.float32, False), (torch.bfloat16, True), (torch.float16, True)])
def test_int4_gemvs_take_int8_activations_in_half_precision_graphs_only(dtype, act8):
    m = compile("preset:tiny-llama", ["fuse", "quant"], {"quant": {"method": "rtn", "group_size": "32"}},
                eval_tokens=0, progress=False)
    low, rep = lower(copy.deepcopy(m.gm).to(dtype), max_len=64, linear="gemv")
    nodes = [n for n in low.graph.nodes if n.target is torch.ops.llmaccel.gemv_int4.default]
    assert nodes and all(n.kwargs["act8"] is act8 for n in nodes)
    assert rep.gemv["int4"] == len(nodes) and rep.gemv["act8"] == (len(nodes) if act8 else 0)
