"""fuse: exact rewrites that save bytes and launches.

- fold a norm's scale (and LayerNorm's bias) into every linear that reads the norm
- fuse linears that read the same input (q, k, v; gate, up) into one linear and a split
- fuse a residual add with the norm that reads it (add_rms_norm / add_layer_norm)
- drop dead nodes and unused weights
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
import torch.fx

from llmaccel import ops
from llmaccel.passes.base import Pass, PassContext, PassResult
from llmaccel.ir import add_weight, fold_affine, is_op, op_nodes, prune_weights, unfuse_linears, weight_of


@dataclass
class FuseConfig:
    norms: bool = True     # fold norm scales into the following linears
    linears: bool = True   # q,k,v -> qkv and gate,up -> gate_up
    add_norm: bool = True  # residual add + norm -> one op


def _can_absorb(gm: torch.fx.GraphModule, user: torch.fx.Node, norm: torch.fx.Node) -> bool:
    if not (is_op(user, ops.linear, ops.lm_head) and user.args[0] is norm):
        return False
    w = user.args[1]
    if is_op(user, ops.linear):
        return True
    # The LM head may absorb the scale only if its weight is its own (not tied to the embedding).
    readers = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == w.target]
    return len(readers) == 1 and len(w.users) == 1


def _fold_norms(gm: torch.fx.GraphModule) -> dict:
    folded, skipped = 0, 0
    for norm in op_nodes(gm, ops.rms_norm, ops.layer_norm):
        is_ln = norm.target is ops.layer_norm
        g_node = norm.args[1]
        b_node = norm.args[2] if is_ln else None
        if g_node is None and b_node is None:
            continue
        users = list(norm.users)
        # Folding is exact only if every reader is a linear that takes the norm as its input;
        # a tied LM head shares its weight with the embedding, so it cannot absorb a scale.
        if not users or not all(_can_absorb(gm, u, norm) for u in users):
            skipped += 1
            continue
        g, beta = weight_of(gm, g_node), weight_of(gm, b_node)
        for lin in users:
            fold_affine(gm, lin, g, beta)
        norm.args = (norm.args[0], None, None) if is_ln else (norm.args[0], None)
        folded += 1
    return {"norms_folded": folded, "norms_kept": skipped}


def _group_name(targets: list[str]) -> str:
    """['layers.0.q.weight', 'layers.0.k.weight', ...] -> 'layers.0.qkv'."""
    stems = [t.removesuffix(".weight") for t in targets]
    prefix = stems[0].rpartition(".")[0]
    leaves = [s.rpartition(".")[2] for s in stems]
    joined = "".join(leaves) if all(len(x) == 1 for x in leaves) else "_".join(leaves)
    return f"{prefix}.{joined}" if prefix else joined


@contextlib.contextmanager
def unfused(gm: torch.fx.GraphModule):
    """The body sees every fused linear split into one linear per part (passes that rewrite q,
    k and v one by one: gqa, the q/k/v fits); what was fused is fused again after. Yields the
    number of groups split."""
    n = unfuse_linears(gm)
    yield n
    if n:
        fuse_linears(gm)
        prune_weights(gm)


def fuse_linears(gm: torch.fx.GraphModule) -> dict:
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for lin in op_nodes(gm, ops.linear):
        groups.setdefault(lin.args[0], []).append(lin)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    fused = 0
    for x, lins in groups.items():
        if len(lins) < 2:
            continue
        ws = [weight_of(gm, lin.args[1]) for lin in lins]
        bs = [weight_of(gm, lin.args[2] if len(lin.args) > 2 else None) for lin in lins]
        first = min(lins, key=order.__getitem__)
        base = _group_name([lin.args[1].target for lin in lins])
        w_node = add_weight(gm, base + ".weight", torch.cat(ws, 0), first)
        b_node = None
        if any(b is not None for b in bs):
            full = [b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(bs, ws)]
            b_node = add_weight(gm, base + ".bias", torch.cat(full), first)
        with gm.graph.inserting_before(first):
            out = gm.graph.call_function(ops.linear, (x, w_node, b_node))
            parts = gm.graph.call_method("split", (out, [w.shape[0] for w in ws]), {"dim": -1})
            for i, lin in enumerate(lins):
                lin.replace_all_uses_with(gm.graph.call_function(operator.getitem, (parts, i)))
        for lin in lins:
            gm.graph.erase_node(lin)
        fused += 1
    return {"linears_fused": fused}


def _fuse_add_norm(gm: torch.fx.GraphModule) -> dict:
    fused = 0
    for norm in op_nodes(gm, ops.rms_norm, ops.layer_norm):
        s = norm.args[0]
        if not (isinstance(s, torch.fx.Node) and is_op(s, operator.add)
                and all(isinstance(a, torch.fx.Node) for a in s.args)):
            continue
        a, b = s.args
        if norm.target is ops.rms_norm:
            target, extra = ops.add_rms_norm, (norm.args[1],)
        else:
            target, extra = ops.add_layer_norm, (norm.args[1], norm.args[2])
        for w in extra:  # weights are read after the add; hoist them so the graph stays ordered
            if isinstance(w, torch.fx.Node):
                s.prepend(w)
        with gm.graph.inserting_before(s):
            fused_node = gm.graph.call_function(target, (a, b, *extra), dict(norm.kwargs))
            normed = gm.graph.call_function(operator.getitem, (fused_node, 0))
            total = gm.graph.call_function(operator.getitem, (fused_node, 1))
        norm.replace_all_uses_with(normed)
        gm.graph.erase_node(norm)
        s.replace_all_uses_with(total)
        gm.graph.erase_node(s)
        fused += 1
    return {"add_norm_fused": fused}


class Fuse(Pass):
    name = "fuse"
    summary = "exact fusions: fold norm scales into linears, fuse qkv and gate/up, residual add + norm"
    exact = True
    config_cls = FuseConfig

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        stats: dict = {}
        if c.norms:
            stats.update(_fold_norms(gm))
        if c.linears:
            stats.update(fuse_linears(gm))
        if c.add_norm:
            stats.update(_fuse_add_norm(gm))
        stats["weights_dropped"] = prune_weights(gm)
        changed = stats.get("norms_folded", 0) + stats.get("linears_fused", 0) + stats.get("add_norm_fused", 0)
        return PassResult(gm, changed, stats)


PASS = Fuse
