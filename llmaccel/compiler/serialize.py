"""IR graph <-> JSON, so that an artifact is rebuilt without pickle and without redoing passes.

Only these targets are resolved on load: the IR ops of the op table (llmaccel/ops/table.py),
and glue from `operator`, `torch` and `torch.nn.functional` (never their file functions).
"""
from __future__ import annotations

import importlib
import operator

import torch
import torch.fx

from llmaccel.errors import LlmaccelError
from llmaccel.ops.table import by_qualname, spec_of

_ALLOWED = ("operator", "torch", "torch.nn.functional")
# torch functions that touch files (torch.load unpickles): never a graph target.
_FILE_IO = ("load", "save", "from_file")


def _target_name(fn) -> str:
    spec = spec_of(fn)
    if spec is not None:
        return spec.qualname
    mod = getattr(fn, "__module__", None) or ""
    if mod == "_operator" or getattr(operator, fn.__name__, None) is fn:
        return "operator." + fn.__name__
    for m in ("torch.nn.functional", "torch"):
        if getattr(importlib.import_module(m), fn.__name__, None) is fn:
            return f"{m}.{fn.__name__}"
    raise LlmaccelError(f"cannot serialize graph target {fn!r} from module {mod!r}")


def _resolve(qual: str):
    mod, _, name = qual.rpartition(".")
    if mod.split(".")[0] == "llmaccel":
        spec = by_qualname(qual)
        if spec is None:
            raise LlmaccelError(f"artifact graph names an unknown op {qual}; is llmaccel too old?")
        return spec.ref
    if mod not in _ALLOWED:
        raise LlmaccelError(f"artifact graph names a target outside the allowed modules: {qual}")
    if name in _FILE_IO:
        raise LlmaccelError(f"artifact graph names a file-reading or -writing target: {qual}")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise LlmaccelError(f"artifact graph names an unknown op {qual}; is llmaccel too old?") from e
    if not callable(fn):
        raise LlmaccelError(f"artifact graph names {qual}, which is not a function")
    return fn


def _enc(a):
    if isinstance(a, torch.fx.Node):
        return {"node": a.name}
    if isinstance(a, tuple):
        return {"tuple": [_enc(x) for x in a]}
    if isinstance(a, list):
        return [_enc(x) for x in a]
    if isinstance(a, dict):
        return {"dict": {k: _enc(v) for k, v in a.items()}}
    if isinstance(a, slice):
        return {"slice": [_enc(a.start), _enc(a.stop), _enc(a.step)]}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise LlmaccelError(f"cannot serialize graph argument {a!r}")


def _dec(a, nodes):
    if isinstance(a, list):
        return [_dec(x, nodes) for x in a]
    if isinstance(a, dict):
        if len(a) != 1:
            raise LlmaccelError(f"graph argument {a!r} has not exactly one key")
        (k, v), = a.items()
        if k == "node":
            if not isinstance(v, str) or v not in nodes:
                raise LlmaccelError(f"graph argument names an undefined node {v!r}")
            return nodes[v]
        if k in ("tuple", "slice") and isinstance(v, list) and (k == "tuple" or len(v) == 3):
            dec = [_dec(x, nodes) for x in v]
            return tuple(dec) if k == "tuple" else slice(*dec)
        if k == "dict" and isinstance(v, dict):
            return {kk: _dec(vv, nodes) for kk, vv in v.items()}
        if k == "dtype" and isinstance(getattr(torch, str(v), None), torch.dtype):
            return getattr(torch, v)
        raise LlmaccelError(f"graph argument {a!r} is malformed")
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise LlmaccelError(f"graph argument {a!r} is malformed")


def graph_to_json(graph: torch.fx.Graph) -> list[dict]:
    out = []
    for n in graph.nodes:
        target = _target_name(n.target) if n.op == "call_function" else n.target
        out.append({"name": n.name, "op": n.op, "target": target,
                    "args": _enc(tuple(n.args))["tuple"], "kwargs": _enc(dict(n.kwargs))["dict"]})
    return out


def graph_from_json(data: list[dict]) -> torch.fx.Graph:
    """The graph a manifest describes; a malformed description raises one LlmaccelError."""
    try:
        return _graph_from_json(data)
    except LlmaccelError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, AssertionError,
            RecursionError) as e:  # what torch.fx raises for an inconsistent graph
        raise LlmaccelError(f"artifact graph is damaged: {type(e).__name__}: {e}") from None


def _graph_from_json(data: list[dict]) -> torch.fx.Graph:
    g = torch.fx.Graph()
    nodes: dict[str, torch.fx.Node] = {}
    for d in data:
        target = _resolve(d["target"]) if d["op"] == "call_function" else d["target"]
        args = tuple(_dec(a, nodes) for a in d["args"])
        kwargs = {k: _dec(v, nodes) for k, v in d["kwargs"].items()}
        if d["op"] == "output":
            g.output(args[0])
            continue
        n = g.create_node(d["op"], target, args, kwargs, name=d["name"])
        nodes[d["name"]] = n
    g.lint()
    return g
