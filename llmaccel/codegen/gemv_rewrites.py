"""The `gemv` lowering rewrite: at one row on CUDA, linears become the fused Triton GEMVs
(kernels/gemv.py) with their neighbours inside (the weightless RMSNorm before, the SiLU-mul or
the residual add after): one launch per linear in a decode step."""
from __future__ import annotations

import operator

import torch
import torch.fx

from llmaccel import ops
from llmaccel.codegen.kernel_ops import custom_op, load_kernel_modules, retarget
from llmaccel.ir import weight_of
from llmaccel.ops import quant as qops


def _gemv_op():
    return custom_op("llmaccel", "gemv")


def _gemv_targets() -> dict:
    """{fused GEMV op: position of its residual argument}."""
    out = {}
    for name, pos in (("gemv", 3), ("gemv_int4", 5)):
        op = custom_op("llmaccel", name)
        if op is not None:
            out[op.default] = pos
    return out


def int4_gemv_weights(node: torch.fx.Node) -> bool:
    """Whether a linear_int4 node (IR op or its custom op) reads stored weights that
    llmaccel::gemv_int4 takes (a power-of-two group size of at least 8)."""
    lin = custom_op("llmaccel", "linear_int4")
    if node.op != "call_function" or not (node.target is qops.linear_int4 or
                                          (lin is not None and node.target in (lin, lin.default))):
        return False
    if len(node.args) > 5 or set(node.kwargs) - {"group_size"}:
        return False  # (x, qweight, scales, zeros, bias) by position, as `quant` writes them
    gs = node.kwargs.get("group_size", 128)
    return isinstance(gs, int) and gs >= 8 and not gs & (gs - 1) and \
        all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in node.args[1:4])


def int8_activations(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether an int4 GEMV rounds x to int8 per group (gemv_a8.py): in graphs of half-precision
    scales (bf16 / fp16 runs, whose x already has 8 bits of mantissa), where the integer dot
    products decode 1.5-1.9x faster; fp32 graphs keep the exact form (greedy identity with the
    reference executor). ΔPPL of the rounding: docs/quality.md."""
    return weight_of(gm, node.args[2]).dtype in (torch.bfloat16, torch.float16)


def _single_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _glu_into_gemv(graph: torch.fx.Graph, g: torch.fx.Node) -> bool:
    """gemv -> split in two halves -> silu_mul(first, second): the gemv computes the product
    (glu=True) and replaces silu_mul; whether it did."""
    split = _single_user(g)
    if split is None or split.op != "call_method" or split.target != "split" or \
            split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else None) != -1:
        return False
    sizes = split.args[1]
    if not isinstance(sizes, (list, tuple)) or len(sizes) != 2 or sizes[0] != sizes[1]:
        return False
    if len(split.users) != 2 or any(u.target is not operator.getitem for u in split.users):
        return False
    parts = {u.args[1]: u for u in split.users if isinstance(u.args[1], int)}
    if set(parts) != {0, 1}:
        return False
    act = _single_user(parts[0])
    if act is None or act.target is not ops.silu_mul or act.args != (parts[0], parts[1]) or \
            len(parts[1].users) != 1:
        return False
    g.kwargs = {**g.kwargs, "glu": True}
    act.replace_all_uses_with(g)
    for n in (act, parts[0], parts[1], split):
        graph.erase_node(n)
    return True


def _residual_into_gemv(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """add_rms_norm(a, b) (weightless) where a or b is a gemv read by nothing else: the gemv adds
    the other operand (its residual), and the norm reads the gemv; whether it did."""
    a, b, weight = node.args[:3]
    targets = _gemv_targets()
    if weight is not None or any(u.target is not operator.getitem for u in node.users):
        return False
    for g, res in ((b, a), (a, b)):
        if isinstance(g, torch.fx.Node) and g.target in targets and len(g.users) == 1 \
                and len(g.args) <= targets[g.target] and "residual" not in g.kwargs \
                and not g.kwargs.get("glu"):
            break
    else:
        return False
    if isinstance(res, torch.fx.Node):  # the gemv will read res: it must come first
        n = res.next
        while n is not g and n.op != "output":
            n = n.next
        if n is not g:
            return False
    g.kwargs = {**g.kwargs, "residual": res}
    normed = [u for u in node.users if u.args[1] == 0]
    for u in [u for u in node.users if u.args[1] == 1]:  # the new residual stream
        u.replace_all_uses_with(g)
        graph.erase_node(u)
    if normed:
        with graph.inserting_after(node):
            norm = graph.call_function(ops.rms_norm, (g, None), {"eps": node.kwargs["eps"]})
        for u in normed:
            u.replace_all_uses_with(norm)
            graph.erase_node(u)
    graph.erase_node(node)
    return True


def _norm_into_gemv(graph: torch.fx.Graph, norm: torch.fx.Node) -> bool:
    """A weightless rms_norm read only by gemvs without a prologue: each computes the norm
    itself (eps) from the norm's input; whether they did."""
    if norm.args[1] is not None or not norm.users:
        return False
    targets = _gemv_targets()
    if not all(u.target in targets and u.args[0] is norm and norm not in u.args[1:]
               and norm not in u.kwargs.values() and "eps" not in u.kwargs for u in norm.users):
        return False
    for u in list(norm.users):
        u.args = (norm.args[0], *u.args[1:])
        u.kwargs = {**u.kwargs, "eps": norm.kwargs["eps"]}
    graph.erase_node(norm)
    return True


def gemv_rewrites(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Linears with stored floating-point weights become llmaccel::gemv, and linear_int4 with
    stored weights llmaccel::gemv_int4, with their neighbours inside: silu_mul after a gate/up
    GEMV, the residual add after an o / down GEMV, the weightless RMSNorm before a GEMV.
    Returns counts {gemv (all GEMVs), int4 (of which gemv_int4), act8 (of which with int8
    activations), glu, residual, norm}."""
    if _gemv_op() is None:
        load_kernel_modules()  # registers llmaccel::gemv and gemv_int4
    counts = dict.fromkeys(("gemv", "int4", "act8", "glu", "residual", "norm"), 0)
    targets = _gemv_targets()
    if not targets:
        return counts
    op, op4 = _gemv_op(), custom_op("llmaccel", "gemv_int4")
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is ops.linear:
            w = node.args[1]
            w = weight_of(gm, w) if isinstance(w, torch.fx.Node) and w.op == "get_attr" else None
            if w is not None and w.dim() == 2 and w.is_floating_point():
                retarget(node, op.default)
                counts["gemv"] += 1
        elif op4 is not None and int4_gemv_weights(node):
            act8 = int8_activations(gm, node)
            node.kwargs = {"group_size": node.kwargs.get("group_size", 128), "act8": act8}
            retarget(node, op4.default)
            counts["gemv"] += 1
            counts["int4"] += 1
            counts["act8"] += act8
    for node in list(graph.nodes):
        if node.target in targets and _glu_into_gemv(graph, node):
            counts["glu"] += 1
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is ops.add_rms_norm and _residual_into_gemv(graph, node):
            counts["residual"] += 1
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is ops.rms_norm and _norm_into_gemv(graph, node):
            counts["norm"] += 1
    return counts
