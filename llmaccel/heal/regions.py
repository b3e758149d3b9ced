"""The heal's forwards compiled one decoder layer at a time (`heal.regional`).

A heal view (heal/train.py: heal_view) is one flat graph of every layer, so torch.compile traces,
differentiates and generates code for each of a model's layers although they are alike. Here
the view is cut into segments, one per layer (the nodes that read the layer's weights and
what follows from them up to the next layer's), and each segment becomes a function of its
inputs, weights included. Segments whose functions are the same (equal code once names are
made positional) call one function, marked with torch.compiler.nested_compile_region: Dynamo
traces it once and stamps the compiled region out for every layer that calls it; the rest of
the graph (embedding, final norm, head) runs around it in the same compiled graph.

Inside a heal view the ops run without a KV cache (ctx is None), so an op's `layer` keyword,
which only names a cache slot, is set to 0 in the regions (likewise sparse_down's `sparsity`,
a kernel hint).
"""
from __future__ import annotations

import operator
import re

import torch
import torch.fx

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.ir import is_op
from llmaccel.ops.kvquant import kv_quant_attention
from llmaccel.ops.sla import linear_attention
from llmaccel.ops.sparse import sparse_down

_CALLS = ("call_function", "call_method", "call_module")
# keywords that do not change what these ops compute in a heal view (no cache), so layers that
# differ only in them share a region: `layer` names a KV-cache slot, sparse_down's `sparsity`
# is its measured sparsity (a kernel's hint). Other ops keep every keyword as it is.
_HINTS = {ops.attention: ("layer",), kv_quant_attention: ("layer",), linear_attention: ("layer",),
          sparse_down: ("sparsity",)}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_of_weight(target: str) -> int | None:
    m = _LAYER.search(target)
    return int(m.group(1)) if m else None


def _labels(g: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Each call node's layer: the highest layer among the weights it reads and the values it
    takes (-1 before the first layer)."""
    label: dict[torch.fx.Node, int] = {}
    for n in g.nodes:
        if n.op == "placeholder":
            label[n] = -1
        elif n.op == "get_attr":
            lay = _layer_of_weight(str(n.target))
            label[n] = -1 if lay is None else lay
        elif n.op in _CALLS:
            label[n] = max([label[a] for a in n.all_input_nodes] or [-1])
    return label


def _segment_module(root: torch.nn.Module, nodes: list[torch.fx.Node], outputs: list[torch.fx.Node],
                    ctx: torch.fx.Node | None):
    """(a GraphModule computing `outputs` from the segment's inputs in first-use order, those
    inputs, its canonical code)."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node | None] = {}
    inputs: list[torch.fx.Node] = []

    def arg(a: torch.fx.Node):   # a node of the segment (copied before), or an input
        if a in env:
            return env[a]
        if a is ctx:   # no cache in a heal view
            env[a] = None
            return None
        inputs.append(a)
        env[a] = g.placeholder(f"a{len(inputs) - 1}")
        return env[a]

    for n in nodes:
        new = g.node_copy(n, arg)
        hints = _HINTS.get(new.target, ()) if ctx is not None else ()
        new.kwargs = {**new.kwargs, **{k: 0 for k in hints if k in new.kwargs}}
        env[n] = new
    g.output(tuple(env[o] for o in outputs))
    for i, n in enumerate(x for x in g.nodes if x.op not in ("placeholder", "output")):
        n.name = f"v{i}"
    gm = torch.fx.GraphModule(root, g, class_name="heal_region")
    return gm, inputs, g.python_code("self").src


def regional(view: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A module computing what `view` computes with each decoder layer a call of a shared,
    nested compile region (module docstring); `view` itself when it has fewer than two layers
    or torch has no nested compile regions (before 2.8)."""
    if getattr(torch.compiler, "nested_compile_region", None) is None:
        return view
    g = view.graph
    label = _labels(g)
    layers = sorted({v for v in label.values() if v >= 0})
    if len(layers) < 2:
        return view
    ctx = next((n for n in g.nodes if n.op == "placeholder" and n.name == "ctx"), None)
    calls = [n for n in g.nodes if n.op in _CALLS]
    segs = {k: [n for n in calls if label[n] == k] for k in layers}
    # the last layer's label also takes what follows it (the final norm): the nodes past the
    # length of the layer before are the epilogue, computed outside the regions
    last, cut = layers[-1], len(segs[layers[-2]])
    head = set(segs[last][:cut])
    while cut and any(is_op(u, operator.getitem) and u not in head for n in head for u in n.users):
        head.discard(segs[last][cut - 1])   # a region returns tensors: no tuple crosses the cut
        cut -= 1
    epilogue = segs[last][cut:]
    segs[last] = segs[last][:cut]
    regions: dict[str, str] = {}   # canonical code -> the submodule that runs it
    holder = torch.nn.Module()
    out = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in g.nodes:   # placeholders, weights and the prologue as they are
        if n.op in ("placeholder", "get_attr") or (n.op in _CALLS and label[n] < 0):
            env[n] = out.node_copy(n, lambda a: env[a])
    for k in layers:
        nodes = segs[k]
        if not nodes:
            continue
        inside = set(nodes)
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        gm, inputs, code = _segment_module(view, nodes, outputs, ctx)
        name = regions.get(code)
        if name is None:
            name = regions[code] = f"heal_region{len(regions)}"
            holder.add_module(name, _Region(gm))
        res = out.call_module(name, tuple(env[a] for a in inputs))
        for i, o in enumerate(outputs):
            env[o] = out.call_function(_item, (res, i))
    if ctx is not None:   # the regions dropped it: a call with a cache must not pass unnoticed
        out.call_function(_no_cache, (env[ctx],))
    for n in epilogue + [n for n in g.nodes if n.op == "output"]:
        env[n] = out.node_copy(n, lambda a: env[a])
    out.lint()
    for name, mod in holder.named_children():
        view.add_module(name, mod)
    module = torch.fx.GraphModule(view, out, class_name="heal_regional")
    module.regions = len(regions)
    return module


class _Region(torch.nn.Module):
    """One segment's function, called by every layer whose segment computes the same."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.gm = gm
        # the segment's own forward (each GraphModule has a class and code of its own): Dynamo
        # reuses a nested region by its code object, so regions must not share a wrapper's
        self.fn = torch.compiler.nested_compile_region(type(gm).forward)

    def forward(self, *args):
        return self.fn(self.gm, *args)


def _no_cache(ctx) -> None:
    if ctx is not None:
        raise LlmaccelError("a heal view compiled by layer runs without a KV cache (ctx must be None)")


def _item(t: tuple, i: int):
    return t[i]


__all__ = ["regional"]
