"""Pass registry: a pass's name is its CLI name, registry key, file name and stats key."""
from __future__ import annotations

import importlib

from llmaccel.errors import LlmaccelError
from llmaccel.passes.base import Pass, PassContext, PassResult

_MODULES = ("fuse",)


def registry() -> dict[str, type[Pass]]:
    """Every pass, by name, in the order `llmc passes` lists them."""
    out: dict[str, type[Pass]] = {}
    for name in _MODULES:
        cls = importlib.import_module(f"llmaccel.passes.{name}").PASS
        assert cls.name == name, f"pass file {name}.py defines pass {cls.name}"
        out[name] = cls
    return out


def get_pass(name: str) -> type[Pass]:
    reg = registry()
    if name not in reg:
        raise LlmaccelError(f"unknown pass {name!r}; known passes: {', '.join(reg)}")
    return reg[name]


__all__ = ["Pass", "PassContext", "PassResult", "registry", "get_pass"]
