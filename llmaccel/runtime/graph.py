"""Graph preparation for the runtime: logits only where needed."""
from __future__ import annotations

import copy

import torch
import torch.fx

from llmaccel import ops
from llmaccel.ir import is_op
from llmaccel.ops import quant as qops


def select_rows(x: torch.Tensor, ctx) -> torch.Tensor:
    """Keep the token rows whose logits the step samples from (a prefill chunk needs none)."""
    idx = None if ctx is None else ctx.logits_indices
    return x if idx is None else x.index_select(1, idx)


torch.fx.wrap("select_rows")


def runtime_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of gm (sharing its weights) whose LM head runs only on the rows the step samples.

    With prefill chunks of thousands of tokens and vocabularies of 100k+, the full logits would
    dominate the step's memory and time.
    """
    graph = copy.deepcopy(gm.graph)
    head = _head(graph)
    ctx_in = [n for n in graph.nodes if n.op == "placeholder"]
    if head is None or len(ctx_in) < 3:
        return gm  # unknown shape of graph: compute all logits, the engine indexes them after
    with graph.inserting_before(head):
        sel = graph.call_function(select_rows, (head.args[0], ctx_in[2]))
    head.update_arg(0, sel)
    out = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    out.selects_rows = True
    return out


def _head(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The node computing the logits from the final hidden states: the lm_head, or the
    row-wise linear that replaced it (`quant.lm_head` makes it a linear_int4 / linear_int8)."""
    heads = [n for n in graph.nodes if is_op(n, ops.lm_head)]
    if heads:
        return heads[0] if len(heads) == 1 else None
    out = graph.output_node().args[0]
    logits = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
    if isinstance(logits, torch.fx.Node) and is_op(logits, ops.linear, qops.linear_int4, qops.linear_int8,
                                                          qops.linear_w8a8):
        return logits
    return None
