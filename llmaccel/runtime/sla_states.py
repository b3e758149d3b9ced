"""LLM's cache for linear-attention (sla) graphs: a recurrent state per sequence, not KV blocks.

An sla layer keeps a state of constant size per sequence (ops/sla.py: S, z, the conv's last
values and, with a window, the kept keys and values). The engine gives each running sequence one
slot: its block manager has one block per slot, `max_position` tokens long, and no prefix
caching (a state sums its whole prefix, so no block of it can be shared), so the scheduler's
admission, preemption and freeing work unchanged and block_table[0] is the slot. A step runs the
op from each slot's state: the decode rows in one call (their states stacked; with a window,
the rows that keep as many tokens, each at its own positions), prefill chunks one by one;
eagerly: no CUDA graph captures a step of these graphs yet.

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

    def __init__(self):
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
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}  # decode rows stepped together -> their rows

    def linear_attend(self, layer, q, k, v, conv_weight, **kw):
        states = [self.states.get(slot, layer, start) for slot, start, _, _ in self.spans]
        outs: list[torch.Tensor | None] = [None] * len(self.spans)
        # one token each from a state (decode rows) with as many kept tokens: one call for all
        groups: dict[int, list[int]] = {}
        for i, ((_, _, a, b), st) in enumerate(zip(self.spans, states)):
            if b - a == 1 and st is not None:
                groups.setdefault(st[3].shape[1] if len(st) > 3 else 0, []).append(i)
        for rows in groups.values():
            if len(rows) > 1:
                self._step_together(layer, rows, states, q, k, v, conv_weight, kw, outs)
        for i, ((slot, start, a, b), st) in enumerate(zip(self.spans, states)):
            if outs[i] is None:
                outs[i], new = sla_forward(q[:, a:b], k[:, a:b], v[:, a:b], conv_weight, state=st, **kw)
                self.states.put(slot, layer, start, start + b - a, new)
        return torch.cat(outs, 1)

    def _step_together(self, layer, rows, states, q, k, v, conv_weight, kw, outs) -> None:
        """The rows' states stacked, one sla_forward for their tokens, the states split again
        (views of the stacked tensors)."""
        key = tuple(rows)
        if key not in self._rows:  # the same rows in every layer: one copy to the device a step
            self._rows[key] = torch.tensor([self.spans[i][2] for i in rows], device=q.device)
        idx = self._rows[key]
        qs, ks, vs = (x[0].index_select(0, idx)[:, None] for x in (q, k, v))
        st = [states[i] for i in rows]
        # tensors with a batch dim (S, z, the conv tail, the kept keys and values) are concatenated;
        # the window's kept positions and count of tokens seen, one per sequence, are stacked
        n = min(len(st[0]), 5)
        stacked = tuple(torch.cat([s[j] for s in st]) for j in range(n)) + \
            tuple(torch.stack([s[j] for s in st]) for j in range(n, len(st[0])))
        out, new = sla_forward(qs, ks, vs, conv_weight, state=stacked, **kw)
        for r, i in enumerate(rows):
            slot, start, _, _ = self.spans[i]
            row = tuple(t[r:r + 1] for t in new[:n]) + tuple(t[r] for t in new[n:])
            self.states.put(slot, layer, start, start + 1, row)
            outs[i] = out[r:r + 1]

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
