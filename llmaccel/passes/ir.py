"""Small helpers that passes share for reading and rewriting IR nodes and weights."""
from __future__ import annotations

import operator

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


def unfuse_linears(gm: torch.fx.GraphModule) -> int:
    """Split every fused linear (one linear read only by a `split` along the last dim, as `fuse`
    writes them) back into one linear per part. Exact. Returns the number of groups split."""
    n = 0
    for lin in op_nodes(gm, ops.linear):
        users = list(lin.users)
        if len(users) != 1 or users[0].op != "call_method" or users[0].target != "split":
            continue
        sp = users[0]
        dim = sp.kwargs.get("dim", sp.args[2] if len(sp.args) > 2 else 0)
        sizes = sp.args[1]
        w_full = weight_of(gm, lin.args[1])
        b_full = weight_of(gm, lin.args[2] if len(lin.args) > 2 else None)
        if dim not in (-1, 1) or not isinstance(sizes, (list, tuple)) or sum(sizes) != w_full.shape[0] \
                or not all(is_op(g, operator.getitem) for g in sp.users):
            continue
        base = lin.args[1].target.removesuffix(".weight")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for g in list(sp.users):
            i = g.args[1]
            rows = slice(starts[i], starts[i] + sizes[i])
            w = add_weight(gm, f"{base}.part{i}.weight", w_full[rows].clone(), g)
            b = None if b_full is None else add_weight(gm, f"{base}.part{i}.bias", b_full[rows].clone(), g)
            with gm.graph.inserting_before(g):
                part = gm.graph.call_function(ops.linear, (lin.args[0], w, b))
            g.replace_all_uses_with(part)
            gm.graph.erase_node(g)
        gm.graph.erase_node(sp)
        gm.graph.erase_node(lin)
        n += 1
    if n:
        prune_weights(gm)
    return n


LINEAR_OPS = (ops.linear,)
NORM_OPS = (ops.rms_norm, ops.layer_norm)
