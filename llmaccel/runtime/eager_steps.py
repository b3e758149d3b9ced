"""The engine core's eager steps: prefill chunks, mixed prefill + decode steps and speculative verification,
one forward of the runtime graph over the flattened batch, sampled on the device.

A step whose tokens nothing needs on the host at once (no speculation, no logprobs, no KIVI
cache) is read one step later: the next step is scheduled without the sequences that wait for
those tokens and launched first, and only then are the tokens read and applied, so that the GPU
runs the next step while the host does this one's bookkeeping and the next one's scheduling
(an 8,192-token prefill step of llama-1b left the H200 idle ~9 of its ~35 ms otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmaccel.runtime.model_runner import lp_pairs
from llmaccel.runtime.sequence import Sequence
from llmaccel.runtime.speculative import verify
from llmaccel.sampling import token_logprobs

MAX_PAUSE = 64   # the longest speculative back-off, in plain decode steps


@dataclass
class HeldStep:
    """An eager step launched whose sampled tokens are not read yet."""
    plan: list                  # (sequence, tokens fed, rows sampled) as the step ran them
    rows: dict[int, int]        # sampled logits row -> its place in toks
    waiting: list[Sequence]     # the sequences whose next token toks holds
    toks: torch.Tensor          # (rows,) int64; on the host once `copied` has completed
    copied: object = None       # the CUDA event after the copy to the host (None: done)


class EagerSteps:
    """The eager steps of an engine core (core.py): they run its model runner and read its
    scheduler, block manager, backend and statistics, and apply tokens with its `append`.
    `held`: the last eager step, launched, whose tokens the next step reads."""

    def __init__(self, core):
        self.core, self.bm, self.sched, self.runner = core, core.bm, core.sched, core.runner
        self.stats = core.stats
        self.held: HeldStep | None = None

    def schedule(self, held: HeldStep | None):
        """The scheduler's next batch; with a held step, without the sequences waiting for its
        tokens (they keep their slots and blocks and are not preempted: their KV is being written)."""
        skip = frozenset(id(s) for s in held.waiting) if held is not None else frozenset()
        return self.sched.schedule(skip)

    def run(self, plan, proposals, held: HeldStep | None = None) -> None:
        """A step with prefill chunks or speculative proposals; `held`, the step before it whose
        tokens are read once this one is launched (or when launching it fails)."""
        self.stats["eager_steps"] += 1
        self.stats["eager_tokens"] += sum(len(toks) for _, toks, _ in plan)
        try:
            logits = self.runner.forward(plan)
            rows, seqs, toks, lps = self.runner.sample(logits, plan, proposals)
        finally:
            if held is not None:
                self.apply(held)
        if not proposals and self.core.backend.holds_steps and lps is None and seqs:
            # held before any host state moves: a failure here leaves the step to run again
            pending = self._hold(plan, rows, seqs, toks)
            for seq, fed, _ in plan:
                seq.num_computed += len(fed)
                # its full blocks' tokens are all known: a prompt of the next step may share them
                # (what reads them runs after this step on the stream)
                self.bm.register(seq)
            self.held = pending
            return
        sampled = dict(zip(rows, zip(toks.tolist(), lps or [None] * len(rows)))) if rows else {}
        r = 0
        for seq, fed, nl in plan:
            rows_ = slice(r, r + nl)
            r += nl
            if nl == 0:
                seq.num_computed += len(fed)
            elif seq.id in proposals and len(fed) > 1:
                prop, qprobs = proposals[seq.id]
                greedy = logits[rows_].argmax(-1).tolist() if seq.params.temperature == 0 else None
                new = verify(logits[rows_], prop, qprobs, seq.params, seq.generator, greedy)
                self._spec_stats(seq, len(prop), len(new) - 1)
                seq.num_computed += len(new)  # the fed last token and the accepted proposals
                seq.draft_computed = min(seq.draft_computed, seq.num_computed)
                self.bm.trim(seq, seq.num_computed)
                new_lps = None
                if seq.logprobs is not None:  # row j's logits precede new token j
                    new_lps = lp_pairs(*token_logprobs(logits[rows_][: len(new)],
                                                       torch.tensor(new, device=logits.device),
                                                       seq.params.logprobs))
                self.core.append(seq, new, new_lps)
            else:
                seq.num_computed += len(fed)
                tok, lp = sampled[r - 1]
                self.core.append(seq, [tok], None if lp is None else [lp])
            self.bm.register(seq)
        self._done(plan)

    def _hold(self, plan, rows, seqs, toks) -> HeldStep:
        """The step's tokens on their way to the host (pinned memory, asynchronously on CUDA)."""
        copied = None
        if toks.is_cuda:
            host = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True)
            host.copy_(toks, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            toks = host
        return HeldStep(plan, {row: i for i, row in enumerate(rows)}, seqs, toks, copied)

    def apply(self, held: HeldStep) -> None:
        """Read a held step's tokens and do its bookkeeping (a sequence aborted meanwhile is
        left as it is: its blocks are already free). Every row is applied, and a row that ends
        is finished at once, even when one row's bookkeeping fails (the others' KV counts as
        computed since the launch: a token not applied would be lost); the first failure is
        raised then (the caller fails that request, as after a decode group's)."""
        if held.copied is not None:
            held.copied.synchronize()
        toks = held.toks.tolist()
        r, err = 0, None
        for seq, _, nl in held.plan:
            r += nl
            if seq.finished:
                continue
            try:
                if nl == 1:
                    self.core.append(seq, [toks[held.rows[r - 1]]])
                self.bm.register(seq)
            except Exception as e:  # noqa: BLE001 - raised below, once every row is applied
                err = err if err is not None else e
        self._done(held.plan)
        if err is not None:
            raise err

    def _done(self, plan) -> None:
        self.stats["kv_blocks_peak"] = max(self.stats["kv_blocks_peak"], self.bm.num_used)
        for seq, _, _ in plan:
            if seq.finished:
                self.sched.finish(seq)

    def _spec_stats(self, seq: Sequence, k: int, accepted: int) -> None:
        s = self.stats
        s["spec_proposed"] += k
        s["spec_accepted"] += accepted
        s["spec_verifies"] += 1
        s["spec_emitted"] += accepted + 1
        # Adapt k per sequence: lengthen after a full acceptance, shorten after a full rejection;
        # rejected at one token, pause proposing for 1, 2, 4 .. MAX_PAUSE plain steps (doubling
        # while the misses go on in a row), so text the draft cannot guess decodes at the plain
        # step's speed.
        if accepted == k:
            seq.spec_k = min(self.core.k_max, seq.spec_k + 1)
        elif accepted == 0:
            if k == 1:
                seq.spec_pause = min(MAX_PAUSE, 1 << seq.spec_misses)
                seq.spec_misses += 1
            seq.spec_k = max(1, seq.spec_k - 1)
        if accepted:
            seq.spec_misses = 0
