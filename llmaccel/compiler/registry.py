"""Every pass a compile may name: the graph rewrites (llmaccel/passes) and the training pass
above them (llmaccel/heal), in `llmc passes` order."""
from __future__ import annotations

from llmaccel.errors import LlmaccelError
from llmaccel.heal.heal import Heal
from llmaccel.passes import Pass, rewrites


def registry() -> dict[str, type[Pass]]:
    return {**rewrites(), Heal.name: Heal}


def get_pass(name: str) -> type[Pass]:
    reg = registry()
    if name not in reg:
        raise LlmaccelError(f"unknown pass {name!r}; known passes: {', '.join(reg)}")
    return reg[name]
