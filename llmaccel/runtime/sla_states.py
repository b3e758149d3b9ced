"""LLM's cache for linear-attention (sla) graphs: a recurrent state per sequence, not KV blocks.

An sla layer keeps a state of constant size per sequence (ops/sla.py: S, z, the conv's last
values and, with a window, the kept keys and values). The engine gives each running sequence one
slot: its block manager has one block per slot, `max_position` tokens long, and no prefix
caching (a state sums its whole prefix, so no block of it can be shared), so the scheduler's
admission, preemption and freeing work unchanged and block_table[0] is the slot. The states
live in tensors of all slots, one per state part and layer, with the kept tokens of a window in
a ring of fixed size (ops/sla_window.to_ring), so every state has one shape.

A slot keeps the state each layer started the step from beside the one after it (two buffers,
rows 2 * (slot + 1) and the next; rows 0 and 1 are the scratch pair that the decode runner's
padding rows read and write), so a step that runs again (it failed before its tokens counted)
starts from the right one; a sequence at position 0 (new, or preempted and recomputed) starts
from the empty state. A finished sequence's states stay until its slot is reused.

Decode steps run on the DecodeRunner (runtime/decode.py) as the paged cache's do: CUDA graphs of
sub-steps, sampling inside, several sub-steps per host sync. Its block table of one entry holds
the row pair and the parity that puts the state after `pos` tokens in buffer (pos + parity) % 2
(decode_row), so every sub-step finds its rows on the device from its position alone
(SlaDecodeContext: gather, one ring_decode for all rows, write back); the host records what the
group leaves (ran). Eager steps (prefill chunks, mixed steps) go through SlaContext, one call for
their decode rows and one per prompt chunk.
"""
from __future__ import annotations

import torch

from llmaccel.errors import LlmaccelError
from llmaccel.ir import op_nodes
from llmaccel.ops.context import StepContext
from llmaccel.ops.sla import empty_state, linear_attention, prompts_forward, sla_forward
from llmaccel.ops.sla_window import from_ring, to_ring


def sla_specs(gm: torch.fx.GraphModule) -> dict[int, dict]:
    """layer -> the keyword arguments of its linear_attention op (the state's shapes)."""
    return {n.kwargs["layer"]: dict(n.kwargs) for n in op_nodes(gm, linear_attention)}


class SlaStates:
    """Every slot's state for each layer of `specs` (sla_specs), in two buffers per slot (the
    state a step starts from and the one it leaves), as tensors of all slots (row
    2 * (slot + 1) + buffer, rows 0 and 1 the scratch pair). `fixed`: room for all `slots` at
    once (CUDA graphs keep the tensors' addresses); otherwise grown as slots come into use. The
    tokens each buffer covers are kept on the host."""

    def __init__(self, specs: dict[int, dict], *, slots: int, max_len: int, dtype: torch.dtype,
                 device, fixed: bool = False):
        self.specs, self.slots, self.dtype, self.device = specs, slots, dtype, torch.device(device)
        self.block_size = max_len                              # the block manager's: one block per slot
        self.store: dict[int, list[torch.Tensor]] = {}        # layer -> state tensors (2 * (slots + 1), ...)
        # slot -> tokens its buffer 0, 1 covers, in every layer: a step's layers all read one buffer
        # and write the other, and the host records that once the whole forward has run
        self.covers: dict[int, list[int]] = {}
        self.room = 0                                         # slots the tensors hold
        # one empty row per layer: what a decode row at position 0 starts from (SlaDecodeContext)
        self.blank = {layer: empty_state(1, dtype=dtype, device=self.device, **spec)
                      for layer, spec in specs.items()}
        if fixed:
            self._grow(slots)

    def _grow(self, n: int) -> None:
        for layer, spec in self.specs.items():
            old = self.store.get(layer, ())
            new = list(empty_state(2 * (n + 1), dtype=self.dtype, device=self.device, **spec))
            for o, t in zip(old, new):
                t[:o.shape[0]] = o
            self.store[layer] = new
        self.room = n

    def _reserve(self, slot: int) -> None:
        if slot >= self.room:   # room for twice the slots in use, at most all of them
            self._grow(min(self.slots, max(2 * self.room, slot + 1)))

    def route(self, slot: int, start: int) -> tuple[int | None, int]:
        """(the row holding `slot`'s state after its first `start` tokens (None: the empty state),
        the row its state after this step goes to: the slot's other buffer), in every layer."""
        if not 0 <= slot < self.slots:
            raise LlmaccelError(f"slot {slot} is outside the {self.slots} slots of the sla states")
        self._reserve(slot)
        cov = self.covers.setdefault(slot, [-1, -1])
        base = 2 * (slot + 1)
        if start == 0:   # a new sequence in the slot: what it held before is not its state
            cov[:] = [-1, -1]
            return None, base
        for b in (0, 1):
            if cov[b] == start:
                return base + b, base + 1 - b
        raise LlmaccelError(f"slot {slot} holds no recurrent state after {start} tokens (it holds "
                            f"{max(cov)}); a linear-attention (sla) state cannot be rebuilt from another point")

    def commit(self, row: int, tokens: int) -> None:
        """Row `row` now holds its slot's state after `tokens` tokens, in every layer."""
        self.covers[row // 2 - 1][row % 2] = tokens

    def decode_row(self, slot: int, start: int) -> int:
        """The decode runner's table entry for `slot` stepping on from `start` tokens: its row
        pair plus the parity p such that the state after `pos` tokens is in buffer (pos + p) % 2
        (from position 0 the step writes buffer 0, so it reads buffer 1: p = 1)."""
        src, dst = self.route(slot, start)
        return 2 * (slot + 1) + ((src if src is not None else dst + 1) + start) % 2

    def ran(self, entry: int, start: int, n: int) -> None:
        """A group of n decode sub-steps from `start` ran on decode_row's `entry`: the state after
        start + n tokens is in one buffer, after start + n - 1 in the other."""
        base, par = entry - entry % 2, entry % 2
        self.commit(base + (start + n + par) % 2, start + n)
        self.commit(base + (start + n - 1 + par) % 2, start + n - 1)

    def gather(self, layer: int, rows: torch.Tensor) -> tuple:
        return tuple(t.index_select(0, rows) for t in self.store[layer])

    def write(self, layer: int, rows: torch.Tensor, state: tuple) -> None:
        """The states of `rows` (one per row of each tensor in `state`)."""
        for t, x in zip(self.store[layer], state):
            t.index_copy_(0, rows, x.to(t.dtype))

    def fresh(self, layer: int, state: tuple, empty: torch.Tensor) -> tuple:
        """`state` with the rows where `empty` (B,) holds replaced by the empty state."""
        return tuple(torch.where(empty.view(-1, *[1] * (x.dim() - 1)), b, x)
                     for x, b in zip(state, self.blank[layer]))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:  # only prefix caching copies blocks, and it is off for these graphs
            raise RuntimeError("a linear-attention state slot cannot be copied")

    def nbytes(self) -> int:
        return sum(t.nbytes for st in self.store.values() for t in st)


class _LinearOnly(StepContext):
    def attend(self, layer, *args, **kw):
        raise LlmaccelError(f"layer {layer} is softmax attention in a graph with linear attention; "
                            f"LLM runs graphs whose attention layers are all sla")


class SlaDecodeContext(_LinearOnly):
    """The context of a decode sub-step on the DecodeRunner (runtime/decode.py): one token per
    row at positions `pos` (B,), tables (B, 1) from SlaStates.decode_row (the scratch pair, 0,
    for padding rows). A row at position 0 (a one-token prompt, a padding row) starts from the
    empty state. Static shapes, nothing read back to the host: CUDA graphs capture it."""

    def __init__(self, states: SlaStates, pos: torch.Tensor, tables: torch.Tensor):
        self.states = states
        # the rows every layer reads and writes, computed once a sub-step
        t = tables[:, 0].long()
        par = (pos + t) % 2                             # the buffer holding the state after pos
        base = t - t % 2
        self.src, self.dst, self.empty = base + par, base + 1 - par, pos == 0

    def linear_attend(self, layer, q, k, v, conv_weight, **kw):
        st = self.states
        state = st.fresh(layer, st.gather(layer, self.src), self.empty)
        out, new = sla_forward(q[0, :, None], k[0, :, None], v[0, :, None], conv_weight, state=state, **kw)
        st.write(layer, self.dst, new)
        return out.transpose(0, 1)


def prompt_groups(lens: dict[int, int]) -> list[list[int]]:
    """Spans of new prompts (span -> length) in groups that one padded call runs: longest first,
    a group taking the next prompt while its padding stays within its tokens (padded to the
    longest, the call computes at most twice the group's tokens)."""
    groups, order = [], sorted(lens, key=lambda i: -lens[i])
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and (len(g) + 1) * lens[g[0]] <= 2 * (sum(lens[j] for j in g) + lens[i]):
            g.append(i)
        else:
            groups.append([i])
    return groups


class SlaContext(_LinearOnly):
    """The step's context for the graph's linear_attention ops (ops/sla.py: ctx.linear_attend)
    over a flattened batch: `spans` = (slot, start position, first row, end row) per sequence.
    The engine puts the decode rows (one token from a state) first: their states are gathered,
    stepped in one call and written back; new prompts (from position 0) run in padded groups
    (prompts_forward: one call each, prompt_groups), and a prompt chunk that continues a state
    runs alone. Where each sequence's state is read and written is decided once for the step;
    commit() records it once the forward has run (a forward that breaks off leaves the states
    the step started from where they were)."""

    def __init__(self, states: SlaStates, spans: list[tuple[int, int, int, int]],
                 logits_indices: torch.Tensor, device):
        self.states, self.spans, self.logits_indices, self.device = states, spans, logits_indices, device
        self.routes = [states.route(slot, start) for slot, start, _, _ in spans]
        self._dev: dict[tuple[int, ...], torch.Tensor] = {}   # rows -> on the device, once a step
        self.n_dec = 0   # the leading spans of one token from a state
        while self.n_dec < len(spans) and spans[self.n_dec][1] > 0 and \
                spans[self.n_dec][3] - spans[self.n_dec][2] == 1:
            self.n_dec += 1
        rest = range(self.n_dec, len(spans))
        self.groups = [g for g in prompt_groups({i: spans[i][3] - spans[i][2] for i in rest
                                                 if spans[i][1] == 0}) if len(g) > 1]
        grouped = {i for g in self.groups for i in g}
        self.alone = [i for i in rest if i not in grouped]
        # a group's rows gathered into (prompts, longest) with a zero row (index N) as padding
        self.padding = []
        for g in self.groups:
            sp = [spans[i] for i in g]
            L, N = sp[0][3] - sp[0][2], spans[-1][3]
            self.padding.append([r for _, _, a, b in sp for r in [*range(a, b), *[N] * (L - b + a)]])

    def _rows(self, rows: list[int]) -> torch.Tensor:
        key = tuple(rows)
        if key not in self._dev:   # the same in every layer: one copy to the device a step
            self._dev[key] = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return self._dev[key]

    def commit(self) -> None:
        """The forward ran: each sequence's state after this step is in its destination row."""
        for (_, start, a, b), (_, dst) in zip(self.spans, self.routes):
            self.states.commit(dst, start + b - a)

    def linear_attend(self, layer, q, k, v, conv_weight, **kw):
        st, window, sinks, n_dec = self.states, kw.get("window", 0), kw.get("sinks", 0), self.n_dec
        outs = {}   # first row -> the output of the rows from there, (1, T, H*D)
        if n_dec:   # rows 0 .. n_dec - 1: one token each from a state
            src, dst = (self._rows([r[i] for r in self.routes[:n_dec]]) for i in (0, 1))
            out, new = sla_forward(q[0, :n_dec, None], k[0, :n_dec, None], v[0, :n_dec, None],
                                   conv_weight, state=st.gather(layer, src), **kw)
            st.write(layer, dst, new)
            outs[0] = out.transpose(0, 1)
        for g, at in zip(self.groups, self.padding):
            outs.update(self._prompts(layer, g, at, q, k, v, conv_weight, kw))
        for i in self.alone:
            (_, _, a, b), (src, dst) = self.spans[i], self.routes[i]
            state = None
            if src is not None:
                state = st.gather(layer, self._rows([src]))
                if window:   # window_forward takes the kept tokens in order
                    state = (*state[:3], *from_ring(state[3:]))
            out, new = sla_forward(q[:, a:b], k[:, a:b], v[:, a:b], conv_weight, state=state, **kw)
            if window:
                new = (*new[:3], *to_ring(new[3:], window, sinks))
            st.write(layer, self._rows([dst]), new)
            outs[a] = out
        parts = [outs[a] for a in sorted(outs)]
        return torch.cat(parts, 1) if len(parts) > 1 else parts[0]

    def _prompts(self, layer, group: list[int], at: list[int], q, k, v, conv_weight, kw) -> dict:
        """New prompts `group` (span indices) in one padded call (rows `at`): {first row: output}."""
        spans = [self.spans[i] for i in group]
        L, idx = spans[0][3] - spans[0][2], self._rows(at)

        def padded(x):
            return torch.cat([x[0], x.new_zeros(1, x.shape[-1])]).index_select(0, idx).view(len(spans), L, -1)
        out, new = prompts_forward(padded(q), padded(k), padded(v), self._rows([b - a for _, _, a, b in spans]),
                                   conv_weight, **kw)
        self.states.write(layer, self._rows([self.routes[i][1] for i in group]), new)
        return {a: out[j:j + 1, :b - a] for j, (_, _, a, b) in enumerate(spans)}


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
    return dev([ids]), dev([pos]), SlaContext(states, spans, dev(rows), device)
