"""The graph-rewrite passes: a pass's name is its CLI name, registry key, file name and stats
key. Every pass a compile may name, the training pass (llmaccel/heal) too: compiler/registry.py."""
from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from llmaccel.passes.base import Pass, PassContext, PassResult

# Listing order for `llmc passes`; pass files not named here follow alphabetically.
_ORDER = ("fuse", "quant", "kvquant", "gqa", "relu", "repbn", "sla", "bitlinear")


@cache
def rewrites() -> dict[str, type[Pass]]:
    """Every rewrite pass, by name: each module of this package that exports PASS is one."""
    names = [m.name for m in pkgutil.iter_modules(__path__)]
    names.sort(key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))
    out: dict[str, type[Pass]] = {}
    for name in names:
        cls = getattr(importlib.import_module(f"{__name__}.{name}"), "PASS", None)
        if cls is None:
            continue  # a helper module (base, fitting, sampled), not a pass
        if cls.name != name:
            raise RuntimeError(f"pass file {name}.py defines pass {cls.name!r}")
        out[name] = cls
    return out


__all__ = ["Pass", "PassContext", "PassResult", "rewrites"]
