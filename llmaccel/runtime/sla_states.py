"""LLM's cache for linear-attention (sla) graphs: a recurrent state per sequence, not KV blocks.

An sla layer keeps a state of constant size per sequence (ops/sla.py: S, z, the conv's last
values and, with a window, the kept keys and values). The engine gives each running sequence one
slot: its block manager has one block per slot, `max_position` tokens long, and no prefix
caching (a state sums its whole prefix, so no block of it can be shared), so the scheduler's
admission, preemption and freeing work unchanged and block_table[0] is the slot. The states
live in tensors of all slots, one per state part and layer, with the kept tokens of a window in
a ring of fixed size (ops/sla_window.to_ring), so a decode step gathers its rows' states, runs
one call for all of them (ring_decode: static shapes, no read back to the host) and writes them
back; prefill chunks run one by one. Eagerly: no CUDA graph captures a step of these graphs yet.

A slot keeps the state each layer started the step from beside the one after it (two buffers),
so a step that runs again (it failed before its tokens counted) starts from the right one; a
sequence at position 0 (new, or preempted and recomputed) starts from the empty state. A
finished sequence's states stay until its slot is reused.
"""
from __future__ import annotations

import torch

from llmaccel.errors import LlmaccelError
from llmaccel.ops.sla import sla_forward
from llmaccel.ops.sla_window import from_ring, to_ring


class SlaStates:
    """Every slot's state for each layer, in two buffers per slot (the state a step starts from
    and the one it leaves), as tensors of all slots (row 2 * slot + buffer; grown as slots come
    into use); with a window the kept tokens are in the ring form (ops/sla_window.to_ring), so
    every slot's state has one shape. The tokens each buffer covers are kept on the host."""

    def __init__(self):
        self.store: dict[int, list[torch.Tensor]] = {}        # layer -> state tensors (2 * slots, ...)
        self.covers: dict[int, dict[int, list[int]]] = {}     # layer -> slot -> tokens in buffer 0, 1

    def route(self, layer: int, slot: int, start: int) -> tuple[int | None, int]:
        """(the row holding `slot`'s state after its first `start` tokens (None: the empty state),
        the row its state after this step goes to: the slot's other buffer)."""
        cov = self.covers.setdefault(layer, {}).setdefault(slot, [-1, -1])
        if start == 0:   # a new sequence in the slot: what it held before is not its state
            cov[:] = [-1, -1]
            return None, 2 * slot
        for b in (0, 1):
            if cov[b] == start:
                return 2 * slot + b, 2 * slot + 1 - b
        raise LlmaccelError(f"layer {layer} has no recurrent state after {start} tokens in slot {slot}; "
                            f"a linear-attention (sla) state cannot be rebuilt from a later point")

    def commit(self, layer: int, row: int, tokens: int) -> None:
        """Row `row` now holds its slot's state after `tokens` tokens."""
        self.covers[layer][row // 2][row % 2] = tokens

    def gather(self, layer: int, rows: torch.Tensor) -> tuple:
        return tuple(t.index_select(0, rows) for t in self.store[layer])

    def write(self, layer: int, rows: torch.Tensor, state: tuple, top: int) -> None:
        """The states of `rows` (one per row of each tensor in `state`); `top`: the largest row."""
        st = self.store.get(layer)
        if st is None or st[0].shape[0] <= top:   # grow: room for twice the slots in use
            n = 2 * (top // 2 + 1) * 2
            new = [t.new_zeros((n, *t.shape[1:])) for t in state]
            for old, t in zip(st or (), new):
                t[:old.shape[0]] = old
            self.store[layer] = st = new
        for t, x in zip(st, state):
            t.index_copy_(0, rows, x.to(t.dtype))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:  # only prefix caching copies blocks, and it is off for these graphs
            raise RuntimeError("a linear-attention state slot cannot be copied")

    def nbytes(self) -> int:
        return sum(t.nbytes for st in self.store.values() for t in st)


class SlaContext:
    """The step's context for the graph's linear_attention ops (ops/sla.py: ctx.linear_attend)
    over a flattened batch: `spans` = (slot, start position, first row, end row) per sequence.
    The engine puts the decode rows (one token from a state) first: their states are gathered,
    stepped in one call and written back; each prompt chunk runs alone."""

    def __init__(self, states: SlaStates, spans: list[tuple[int, int, int, int]],
                 logits_indices: torch.Tensor):
        self.states, self.spans, self.logits_indices = states, spans, logits_indices
        self._dev: dict[tuple[int, ...], torch.Tensor] = {}   # rows -> on the device, once a step
        self.n_dec = 0   # the leading spans of one token from a state, the same in every layer
        while self.n_dec < len(spans) and spans[self.n_dec][1] > 0 and \
                spans[self.n_dec][3] - spans[self.n_dec][2] == 1:
            self.n_dec += 1

    def _rows(self, rows: list[int], device) -> torch.Tensor:
        key = tuple(rows)
        if key not in self._dev:   # the same in every layer: one copy to the device a step
            self._dev[key] = torch.tensor(rows, device=device)
        return self._dev[key]

    def linear_attend(self, layer, q, k, v, conv_weight, **kw):
        st, window, sinks, n_dec = self.states, kw.get("window", 0), kw.get("sinks", 0), self.n_dec
        outs = []
        if n_dec:   # rows 0 .. n_dec - 1: one token each from a state
            routes = [st.route(layer, slot, start) for slot, start, _, _ in self.spans[:n_dec]]
            src, dst = (self._rows([r[i] for r in routes], q.device) for i in (0, 1))
            out, new = sla_forward(q[0, :n_dec, None], k[0, :n_dec, None], v[0, :n_dec, None],
                                   conv_weight, state=st.gather(layer, src), **kw)
            st.write(layer, dst, new, max(r[1] for r in routes))
            for (_, start, _, _), (_, row) in zip(self.spans[:n_dec], routes):
                st.commit(layer, row, start + 1)
            outs.append(out.transpose(0, 1))
        for slot, start, a, b in self.spans[n_dec:]:
            src, dst = st.route(layer, slot, start)
            state = None
            if src is not None:
                state = st.gather(layer, self._rows([src], q.device))
                if window:   # window_forward takes the kept tokens in order
                    state = (*state[:3], *from_ring(state[3:]))
            out, new = sla_forward(q[:, a:b], k[:, a:b], v[:, a:b], conv_weight, state=state, **kw)
            if window:
                new = (*new[:3], *to_ring(new[3:], window, sinks))
            st.write(layer, self._rows([dst], q.device), new, dst)
            st.commit(layer, dst, start + b - a)
            outs.append(out)
        return torch.cat(outs, 1) if len(outs) > 1 else outs[0]

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
