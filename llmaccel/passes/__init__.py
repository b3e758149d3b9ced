"""Pass registry: a pass's name is its CLI name, registry key, file name and stats key."""
from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from llmaccel.errors import LlmaccelError
from llmaccel.passes.base import Pass, PassContext, PassResult

# Listing order for `llmc passes`; pass files not named here follow alphabetically.
_ORDER = ("fuse", "quant", "kvquant", "gqa", "relu", "repbn", "sla", "bitlinear", "heal")


@cache
def registry() -> dict[str, type[Pass]]:
    """Every pass, by name: each module of this package that exports PASS is one pass."""
    names = [m.name for m in pkgutil.iter_modules(__path__)]
    names.sort(key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))
    out: dict[str, type[Pass]] = {}
    for name in names:
        cls = getattr(importlib.import_module(f"{__name__}.{name}"), "PASS", None)
        if cls is None:
            continue  # a helper module (base, ir), not a pass
        if cls.name != name:
            raise RuntimeError(f"pass file {name}.py defines pass {cls.name!r}")
        out[name] = cls
    return out


def get_pass(name: str) -> type[Pass]:
    reg = registry()
    if name not in reg:
        raise LlmaccelError(f"unknown pass {name!r}; known passes: {', '.join(reg)}")
    return reg[name]


__all__ = ["Pass", "PassContext", "PassResult", "registry", "get_pass"]
