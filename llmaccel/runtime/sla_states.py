"""LLM's cache for linear-attention (sla) graphs: a recurrent state per sequence, not KV blocks.

An sla layer keeps a state of constant size per sequence (ops/sla.py: S, z, the conv's last
values and, with a window, the kept keys and values). The engine gives each running sequence one
slot: its block manager has one block per slot, `max_position` tokens long, and no prefix
caching (a state sums its whole prefix, so no block of it can be shared), so the scheduler's
admission, preemption and freeing work unchanged and block_table[0] is the slot. A step runs the
op sequence by sequence from its slot's state (the window form's kept positions are per
sequence), eagerly: no CUDA graph captures a step of these graphs yet.

A slot keeps the state each layer started the step from beside the one after it, so a step
that runs again (it failed before its tokens counted) starts from the right one; a sequence at
position 0 (new, or preempted and recomputed) starts from the empty state. A finished
sequence's states stay until its slot is reused: at most two per slot and layer.
"""
from __future__ import annotations

import torch

from llmaccel.errors import LlmaccelError
from llmaccel.ops.sla import sla_forward


class SlaStates:
    """Per slot and layer, up to two (tokens covered, state) pairs."""

    def __init__(self, num_slots: int):
        self.num_blocks = num_slots
        self.slots: dict[int, dict[int, list[tuple[int, tuple]]]] = {}

    def get(self, slot: int, layer: int, start: int) -> tuple | None:
        """The state of `slot` after its first `start` tokens (None: the empty state)."""
        if start == 0:
            return None
        for n, st in self.slots.get(slot, {}).get(layer, ()):
            if n == start:
                return st
        raise LlmaccelError(f"layer {layer} has no recurrent state after {start} tokens in slot {slot}; "
                            f"a linear-attention (sla) state cannot be rebuilt from a later point")

    def put(self, slot: int, layer: int, start: int, end: int, state: tuple) -> None:
        layers = self.slots.setdefault(slot, {})
        layers[layer] = [(n, s) for n, s in layers.get(layer, ()) if n == start and start] + [(end, state)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:  # only prefix caching copies blocks, and it is off for these graphs
            raise RuntimeError("a linear-attention state slot cannot be copied")

    def nbytes(self) -> int:
        return sum(t.nbytes for layers in self.slots.values() for hist in layers.values()
                   for _, st in hist for t in st)


class SlaContext:
    """The step's context for the graph's linear_attention ops (ops/sla.py: ctx.linear_attend)
    over a flattened batch: `spans` = (slot, start position, first row, end row) per sequence."""

    def __init__(self, states: SlaStates, spans: list[tuple[int, int, int, int]],
                 logits_indices: torch.Tensor):
        self.states, self.spans, self.logits_indices = states, spans, logits_indices

    def linear_attend(self, layer, q, k, v, conv_weight, **kw):
        outs = []
        for slot, start, a, b in self.spans:
            st = self.states.get(slot, layer, start)
            out, new = sla_forward(q[:, a:b], k[:, a:b], v[:, a:b], conv_weight, state=st, **kw)
            self.states.put(slot, layer, start, start + b - a, new)
            outs.append(out)
        return torch.cat(outs, 1)

    def attend(self, layer, *args, **kw):
        raise LlmaccelError(f"layer {layer} is softmax attention in a graph with linear attention; "
                            f"LLM runs graphs whose attention layers are all sla")


def build_sla_step(states: SlaStates, items: list[tuple[list[int], int, list[int]]],
                   want_logits: list[int], device) -> tuple[torch.Tensor, torch.Tensor, SlaContext]:
    """Inputs for one forward over `items` = (block table (its one block is the slot), start
    position, new token ids), as kv_cache.build_step: input_ids (1, N), positions (1, N), context."""
    ids, pos, spans, rows = [], [], [], []
    for (table, start, toks), nl in zip(items, want_logits):
        a = len(ids)
        ids.extend(toks)
        pos.extend(range(start, start + len(toks)))
        spans.append((table[0], start, a, len(ids)))
        rows.extend(range(len(ids) - nl, len(ids)))

    def dev(x):
        return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)
    return dev([ids]), dev([pos]), SlaContext(states, spans, dev(rows))
