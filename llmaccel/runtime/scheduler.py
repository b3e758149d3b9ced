"""Scheduler: waiting and running queues, chunked prefill mixed with decode, preemption.

Each step takes, under `max_num_batched_tokens`, first the running sequences (oldest first: their
decode token, speculative proposals, or next prefill chunk), then admits waiting ones. When the
KV blocks run out, the newest running sequence (other than those whose next token is still being
computed: `skip`) is preempted: its blocks are freed and it goes back
to the front of the waiting queue with its generated tokens kept, to be recomputed later (its
sampler state is untouched, so the output is the same as if it had never been preempted).
"""
from __future__ import annotations

from collections import deque

from llmaccel.runtime.block_manager import BlockManager
from llmaccel.runtime.sequence import Sequence


class Scheduler:
    def __init__(self, bm: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.bm = bm
        self.max_num_seqs, self.max_batched = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.capacity = bm.capacity
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.running_peak = 0   # the most sequences that held cache blocks at once

    def reject_reason(self, seq: Sequence) -> str | None:
        n = seq.n_prompt
        if n == 0:
            return "the prompt is empty"
        if n >= self.max_model_len:
            return (f"the prompt has {n} tokens; the model context is {self.max_model_len} "
                    f"(prompt plus at least one new token must fit)")
        if not self.bm.holds(n, n):
            return f"the prompt has {n} tokens; the whole KV cache holds {self.capacity}"
        return None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.bm.free_seq(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (waiting or running) and free its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq)

    def requeue(self, seq: Sequence) -> None:
        """Compute a running sequence again from its first token, as after a preemption (its
        recurrent state, over sla graphs, went past what the host applied when a step failed)."""
        if seq in self.running:
            self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.num_computed = seq.draft_computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _fit(self, seq: Sequence, q: int) -> bool:
        end = seq.num_computed + q
        if not self.bm.can_grow(seq, end):
            return False
        self.bm.grow(seq, end)
        return self.bm.make_writable(seq, seq.num_computed, end)

    def _chunk(self, seq: Sequence, q: int) -> int:
        """q shortened so that a chunk that stops short of the end ends on a multiple of the
        block manager's chunk unit (KIVI: a quantization group); may become 0."""
        end = seq.num_computed + q
        if end < len(seq.token_ids):
            q -= end % self.bm.chunk_unit
        return max(0, q)

    def _spec_k(self, seq: Sequence) -> int:
        if seq.spec_pause:   # backing off (eager_steps): this step is a plain one
            seq.spec_pause -= 1
            return 0
        left = seq.params.max_tokens - seq.n_output - 1
        return max(0, min(seq.spec_k, left, self.max_model_len - len(seq.token_ids) - 1))

    def schedule(self, skip: frozenset = frozenset()) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """Returns ([(sequence, tokens to feed)] with single tokens first, [sequences that
        cannot fit even alone in the cache and so end with finish_reason 'length']).

        skip: ids of running sequences left out of this step and never preempted by it (their
        next token is still being computed); they keep their slots and blocks."""
        batch: list[tuple[Sequence, int]] = []
        too_long: list[Sequence] = []
        budget = self._step_running(self.max_batched, skip, batch, too_long)
        self._admit_waiting(budget, batch, too_long)
        self.running_peak = max(self.running_peak, len(self.running))
        batch.sort(key=lambda sq: sq[1] != 1)
        return batch, too_long

    def _step_running(self, budget: int, skip: frozenset, batch: list, too_long: list) -> int:
        """The running sequences' tokens of this step, in order, preempting from the back where
        the cache is full; returns the token budget left."""
        unit = self.bm.chunk_unit
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if id(seq) in skip:
                i += 1
                continue
            remaining = len(seq.token_ids) - seq.num_computed
            if not self.bm.holds(len(seq.token_ids), seq.n_prompt):
                self.running.pop(i)
                self.bm.free_seq(seq)
                too_long.append(seq)
                continue
            if remaining == 1:
                q = 1 + min(self._spec_k(seq), budget - 1)
            else:  # a prefill chunk shrinks to the blocks there are before anyone is preempted
                q = self._chunk(seq, min(remaining, budget, max(unit, self.bm.room(seq))))
                if q == 0:  # no group-aligned chunk fits the budget left; its turn comes next step
                    i += 1
                    continue
            while not self._fit(seq, q):
                if q > 1 and remaining == 1:
                    q = 1  # drop the speculation before preempting anyone
                    continue
                victim = next((s for s in reversed(self.running) if id(s) not in skip), None)
                if victim is None:
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append((seq, q))
                budget -= q
                i += 1
                continue
            break
        return budget

    def _admit_waiting(self, budget: int, batch: list, too_long: list) -> None:
        """Waiting sequences admitted in order while their remaining prompt fits now."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.bm.holds(len(seq.token_ids), seq.n_prompt):
                self.waiting.popleft()
                too_long.append(seq)
                continue
            if not seq.block_table:
                seq.num_computed = self.bm.match_prefix(seq)
            remaining = len(seq.token_ids) - seq.num_computed
            # Admit only when the whole remaining prompt fits now, so it is not preempted at once.
            q = self._chunk(seq, min(remaining, budget))
            if q == 0 or not self.bm.can_grow(seq, len(seq.token_ids)) or not self._fit(seq, q):
                self.bm.free_seq(seq)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, q))
            budget -= q
