"""Small helpers that passes share for reading and rewriting IR nodes and weights."""
from __future__ import annotations

import torch
import torch.fx

from llmaccel import ops
from llmaccel.compiler.families import set_weight


def is_op(node: torch.fx.Node, *fns) -> bool:
    return node.op == "call_function" and node.target in fns


def op_nodes(gm: torch.fx.GraphModule, *fns) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if is_op(n, *fns)]


def weight_of(gm: torch.fx.GraphModule, node) -> torch.Tensor | None:
    """The tensor behind a get_attr node (None for a None argument)."""
    if node is None:
        return None
    assert isinstance(node, torch.fx.Node) and node.op == "get_attr", node
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj


def fresh_name(gm: torch.fx.GraphModule, base: str) -> str:
    names = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    names |= {k for k, _ in gm.named_parameters()} | {k for k, _ in gm.named_buffers()}
    if base not in names:
        return base
    i = 1
    while f"{base}_{i}" in names:
        i += 1
    return f"{base}_{i}"


def add_weight(gm: torch.fx.GraphModule, base: str, value: torch.Tensor, before: torch.fx.Node) -> torch.fx.Node:
    """Register a new tensor under an unused name and return a get_attr node for it."""
    name = fresh_name(gm, base)
    set_weight(gm, name, value)
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(name)


def replace_weight(gm: torch.fx.GraphModule, node: torch.fx.Node, value: torch.Tensor,
                   user: torch.fx.Node) -> torch.fx.Node:
    """A get_attr node holding `value` for `user`: the same name when no one else reads it."""
    readers = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == node.target]
    if len(readers) == 1 and list(node.users) == [user]:
        set_weight(gm, node.target, value)
        return node
    return add_weight(gm, node.target, value, user)


def prune_weights(gm: torch.fx.GraphModule) -> int:
    """Drop dead nodes, then every parameter no get_attr node reads. Returns weights dropped."""
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    dropped = 0
    for name, _ in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name not in used:
            *path, leaf = name.split(".")
            mod = gm.get_submodule(".".join(path)) if path else gm
            if leaf in mod._parameters:
                del mod._parameters[leaf]
            else:
                del mod._buffers[leaf]
            dropped += 1
    return dropped


LINEAR_OPS = (ops.linear,)
NORM_OPS = (ops.rms_norm, ops.layer_norm)
