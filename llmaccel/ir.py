"""The graph helpers of the IR, at the bottom of the layers: queries and rewrites of nodes and
weights that passes, lowering and the compiler share."""
from __future__ import annotations

import copy
import operator
from collections import Counter

import torch
import torch.fx
import torch.nn as nn

from llmaccel import ops
from llmaccel.ops.table import spec_of


def positions(ids: torch.Tensor) -> torch.Tensor:
    """Positions 0 .. T-1 of every row of ids (B, T): a graph's whole-sequence call (no cache)
    is gm(ids, positions(ids), None)."""
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


def set_weight(root: nn.Module, name: str, value: torch.Tensor) -> None:
    """Attach a tensor at a dotted name, creating holder modules on the way."""
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if leaf in mod._parameters:
        del mod._parameters[leaf]
    mod.register_parameter(leaf, nn.Parameter(value, requires_grad=False))


def get_attr(gm: nn.Module, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def graph_weights(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every tensor the graph reads through get_attr, by target name."""
    return {n.target: get_attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}


def op_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """{op name: nodes}: IR ops by their table name, anything else as glue:NAME."""
    c: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            spec = spec_of(n.target)
            c[spec.name if spec is not None else f"glue:{n.target.__name__}"] += 1
        elif n.op == "call_method":
            c[f"glue:.{n.target}"] += 1
    return dict(sorted(c.items()))


def attention_layers(gm: torch.fx.GraphModule) -> dict[int, tuple[int, int]]:
    """{layer: (n_kv_heads, head_dim)} of the graph's attention ops (the table's ops that take an
    attention context; passes may change the heads)."""
    out = {}
    for n in gm.graph.nodes:
        spec = spec_of(n.target) if n.op == "call_function" else None
        if spec is not None and spec.context:
            out[int(n.kwargs["layer"])] = (int(n.kwargs["n_kv_heads"]), int(n.kwargs["head_dim"]))
    return out


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


def probe(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """A module sharing gm's weights whose forward returns the values of `nodes` (a tuple), so a
    pass can measure activations on calibration text without touching gm."""
    g = copy.deepcopy(gm.graph)
    by_name = {n.name: n for n in g.nodes}
    out = next(n for n in g.nodes if n.op == "output")
    out.args = (tuple(by_name[n.name] for n in nodes),)
    g.eliminate_dead_code()   # stop at the last value asked for (no LM head after an MLP's gate)
    return torch.fx.GraphModule(gm, g, class_name="probe")


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


def fold_affine(gm: torch.fx.GraphModule, lin: torch.fx.Node, scale: torch.Tensor | None,
                shift: torch.Tensor | None, *, own_weight: str | None = None) -> dict:
    """Rewrite lin(scale * x + shift) as one linear of x: W' = W diag(scale), b' = W shift + b.

    Computed in float64, stored in the weight's dtype. A weight read elsewhere too (a tied LM
    head) is rewritten in place only if `own_weight` is None; otherwise lin gets its own copy
    under that name. Returns {"biased": a bias was added, "untied": a copy was made}.
    """
    w_node = lin.args[1]
    b_old = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
    w, b = weight_of(gm, w_node), weight_of(gm, b_old)
    wd = w.detach().double()
    new_w = (wd * scale.double().to(w.device)[None, :] if scale is not None else wd).to(w.dtype)
    new_b = None
    if shift is not None:
        new_b = wd @ shift.double().to(w.device) + (b.detach().double() if b is not None else 0.0)
    elif b is not None:
        new_b = b.detach().double()
    readers = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == w_node.target]
    untied = own_weight is not None and (len(readers) > 1 or list(w_node.users) != [lin])
    w_node2 = add_weight(gm, own_weight, new_w, lin) if untied else replace_weight(gm, w_node, new_w, lin)
    if new_b is None:
        b_node2 = None
    elif b_old is not None:
        b_node2 = replace_weight(gm, b_old, new_b.to(b.dtype), lin)
    else:
        b_node2 = add_weight(gm, w_node2.target.removesuffix("weight") + "bias", new_b.to(w.dtype), lin)
    lin.args = (lin.args[0], w_node2, b_node2)
    lin.kwargs = {}
    return {"biased": new_b is not None and b_old is None, "untied": untied}


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
