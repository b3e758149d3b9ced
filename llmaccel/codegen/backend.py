"""The torch.compile backend `llmaccel`: lift torch-level patterns to IR ops, lower, then Inductor.

    torch.compile(model, backend="llmaccel")   # registered by the torch_dynamo_backends entry point

Dynamo hands over graphs of arbitrary models. Lifting recognises
- F.linear                                       -> ops.linear
- the RMSNorm formula (x.float() * rsqrt(mean(x^2) + eps), cast back, times a weight)
                                                 -> ops.rms_norm
- silu(a) * b                                    -> ops.silu_mul
so that the graph carries the same ops as a captured model and lowering can swap in the
`llmaccel::*` custom ops that kernel modules register. scaled_dot_product_attention stays as it
is (Inductor compiles it). What is not recognised is left untouched for Inductor.
"""
from __future__ import annotations

import operator
import sys
from collections import Counter

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.codegen.lower import lower

_LINEAR = (torch._C._nn.linear, F.linear)
_SILU = (F.silu, torch.nn.functional.silu, torch.ops.aten.silu.default)
_MUL = (operator.mul, torch.mul)


def _meta(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _is_method(node, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name


def _is_fn(node, fns) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in fns


def _arg(node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _cast_to(node) -> torch.dtype | None:
    """The dtype of `x.to(dtype)` / `x.to(dtype=...)`, else None."""
    if not _is_method(node, "to") or len(node.args) > 2:
        return None
    d = node.args[1] if len(node.args) == 2 else node.kwargs.get("dtype")
    extra = set(node.kwargs) - {"dtype", "device"} if len(node.args) == 1 else set(node.kwargs)
    return d if isinstance(d, torch.dtype) and not extra else None


def _erase_dead(graph: torch.fx.Graph, nodes) -> None:
    for n in reversed(nodes):
        if n.graph is graph and not n.users:
            graph.erase_node(n)


def _lift_linear(gm) -> int:
    n_done = 0
    for node in list(gm.graph.nodes):
        if _is_fn(node, _LINEAR):
            x, w = node.args[0], _arg(node, 1, "weight")
            node.target, node.args, node.kwargs = ops.linear, (x, w, _arg(node, 2, "bias")), {}
            n_done += 1
    return n_done


def _match_rms(rsqrt: torch.fx.Node):
    """From an rsqrt node, the pieces of x.float() * rsqrt(x.pow(2).mean(-1, True) + eps)."""
    add = rsqrt.args[0] if rsqrt.args else None
    if not _is_fn(add, (operator.add, torch.add)) or not isinstance(add.args[1], float):
        return None
    mean, eps = add.args
    if not _is_method(mean, "mean") or tuple(mean.args[1:]) not in ((-1,), ((-1,),), ([-1],)):
        return None
    if mean.kwargs.get("keepdim") is not True:
        return None
    pw = mean.args[0]
    if not ((_is_method(pw, "pow") and pw.args[1] == 2) or (_is_fn(pw, (torch.pow,)) and pw.args[1] == 2)):
        return None
    h = pw.args[0]
    muls = [u for u in rsqrt.users if _is_fn(u, _MUL) and h in u.args]
    if len(muls) != 1:
        return None
    x = h.args[0] if _cast_to(h) == torch.float32 else h
    xv, hv = _meta(x), _meta(h)
    if xv is None or hv is None or hv.dtype != torch.float32:
        return None
    return x, eps, muls[0], [h, pw, mean, add, rsqrt, muls[0]]


def _lift_rms_norm(gm) -> int:
    graph, n_done = gm.graph, 0
    for rsqrt in list(graph.nodes):
        if not (_is_fn(rsqrt, (torch.rsqrt,)) or _is_method(rsqrt, "rsqrt")):
            continue
        m = _match_rms(rsqrt)
        if m is None:
            continue
        x, eps, normed, chain = m
        out, dt = normed, _meta(x).dtype
        users = list(out.users)
        if len(users) == 1 and _cast_to(users[0]) == dt:
            out = users[0]
            chain.append(out)
        elif dt != torch.float32:
            continue  # the formula without the cast back is not the op's semantics
        weight = None
        users = list(out.users)
        if len(users) == 1 and _is_fn(users[0], _MUL):
            other = [a for a in users[0].args if a is not out]
            wv = _meta(other[0]) if len(other) == 1 else None
            if wv is not None and wv.dim() == 1 and wv.shape[0] == _meta(x).shape[-1] and wv.dtype == dt:
                weight, out = other[0], users[0]
                chain.append(out)
        with graph.inserting_before(out):
            new = graph.call_function(ops.rms_norm, (x, weight), {"eps": eps})
        new.meta = dict(out.meta)
        out.replace_all_uses_with(new)
        _erase_dead(graph, chain)
        n_done += 1
    return n_done


def _lift_silu_mul(gm) -> int:
    graph, n_done = gm.graph, 0
    for mul in list(graph.nodes):
        if not _is_fn(mul, _MUL) or len(mul.args) != 2:
            continue
        a, b = mul.args
        for s, other in ((a, b), (b, a)):
            if (_is_fn(s, _SILU) and not s.kwargs.get("inplace", False) and len(s.users) == 1
                    and isinstance(other, torch.fx.Node)):
                mul.target, mul.args, mul.kwargs = ops.silu_mul, (s.args[0], other), {}
                graph.erase_node(s)
                n_done += 1
                break
    return n_done


def lift(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Rewrite recognised torch-level patterns in place into llmaccel.ops nodes; returns counts."""
    stats = Counter(linear=_lift_linear(gm), rms_norm=_lift_rms_norm(gm), silu_mul=_lift_silu_mul(gm))
    gm.graph.lint()
    gm.recompile()
    return dict(stats)


def _inner(name: str):
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx
        return compile_fx
    from torch._dynamo.backends.registry import lookup_backend
    return lookup_backend(name)


def _frame_name() -> str:
    """What Dynamo is compiling: `Class.method` for a module's method, the class alone for a
    module called through a decorator's wrapper (transformers' forward: the module is the
    wrapper's args[0]), else the function's qualified name. Dynamo's translator is private
    API: a torch without it gets a generic name."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code, local = tx.f_code, tx.f_locals
    except Exception:  # noqa: BLE001 - the name is only for the message
        return "a graph"
    if isinstance(local.get("self"), torch.nn.Module):
        return f"{type(local['self']).__name__}.{code.co_name}"
    args = local.get("args")
    if isinstance(args, tuple) and args and isinstance(args[0], torch.nn.Module):
        return type(args[0]).__name__
    return code.co_qualname


def _announce(gm: torch.fx.GraphModule, stats: dict[str, int], inner: str) -> None:
    """One line on stderr as a compile starts: Inductor takes tens of seconds on a CPU for a
    small LLM (SmolLM2-135M: ~30 s on 2 cores), which the first call would wait through
    silently. Dynamo calls the backend once per graph it compiles (again only for new shapes
    or after a graph break), so calls that reuse a compiled graph print nothing."""
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    again = " again (new input shapes or guards)" if cid is not None and cid.frame_compile_id else ""
    lifted = ", ".join(f"{n} {k}" for k, n in stats.items() if n)
    lifted = f"lifted {lifted}" if lifted else "nothing to lift"
    print(f"llmaccel: compiling {_frame_name()}{again} ({len(gm.graph.nodes):,} nodes; {lifted}) "
          f"with {inner}; this call waits for it (tens of seconds for an LLM on a CPU)",
          file=sys.stderr, flush=True)


def make_backend(inner: str = "inductor", select="all", announce: bool = True):
    """A backend that lifts, lowers to custom ops (`select` as in codegen.lower), then runs `inner`;
    `announce`: say so on stderr as each graph's compile starts."""
    def backend(gm: torch.fx.GraphModule, example_inputs):
        stats = lift(gm)
        if announce:
            _announce(gm, stats, inner)
        lowered, rep = lower(gm, max_len=1, select=select)
        backend.last_stats = {"lifted": stats, "custom": rep.custom}
        return _inner(inner)(lowered, example_inputs)
    backend.last_stats = {}
    return backend


llmaccel_backend = make_backend()

__all__ = ["llmaccel_backend", "make_backend", "lift"]
