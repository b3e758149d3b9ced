"""LLM's eager steps: prefill chunks, mixed prefill + decode steps and speculative verification,
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

from llmaccel.runtime.kivi_cache import build_kivi_step
from llmaccel.runtime.kv_cache import build_step
from llmaccel.runtime.sequence import Sequence
from llmaccel.runtime.sla_states import build_sla_step
from llmaccel.runtime.speculative import verify
from llmaccel.sampling import logprob_pairs, logprobs_wanted, sample_mode, sample_rows, token_logprobs


def lp_pairs(lp: torch.Tensor, top) -> list[tuple[float, list]]:
    """token_logprobs' tensors as per-row (logprob, [(id, logprob)]) on the host."""
    return logprob_pairs(lp.tolist(), *(() if top is None else (top[0].tolist(), top[1].tolist())))


@dataclass
class HeldStep:
    """An eager step launched whose sampled tokens are not read yet."""
    plan: list                  # (sequence, tokens fed, rows sampled) as the step ran them
    rows: dict[int, int]        # sampled logits row -> its place in toks
    waiting: list[Sequence]     # the sequences whose next token toks holds
    toks: torch.Tensor          # (rows,) int64; on the host once `copied` has completed
    copied: object = None       # the CUDA event after the copy to the host (None: done)


class EagerSteps:
    """LLM's eager steps (a part of LLM: they read its graph, cache, scheduler, block manager,
    draft and statistics, and apply tokens with its _append)."""

    def _schedule(self, held: HeldStep | None):
        """The scheduler's next batch; with a held step, without the sequences waiting for its
        tokens (they keep their slots and blocks and are not preempted: their KV is being written)."""
        skip = frozenset(id(s) for s in held.waiting) if held is not None else frozenset()
        return self.sched.schedule(skip)

    def _eager_step(self, plan, proposals, held: HeldStep | None = None) -> None:
        """A step with prefill chunks or speculative proposals; `held`, the step before it whose
        tokens are read once this one is launched (or when launching it fails)."""
        self.stats["eager_steps"] += 1
        self.stats["eager_tokens"] += sum(len(toks) for _, toks, _ in plan)
        try:
            logits = self._forward(plan)
            rows, seqs, toks, lps = self._sample(logits, plan, proposals)
        finally:
            if held is not None:
                self._apply(held)
        if not proposals and not self.kivi and lps is None and seqs:
            # held before any host state moves: a failure here leaves the step to run again
            pending = self._hold(plan, rows, seqs, toks)
            for seq, fed, _ in plan:
                seq.num_computed += len(fed)
                # its full blocks' tokens are all known: a prompt of the next step may share them
                # (what reads them runs after this step on the stream)
                self.bm.register(seq)
            self._eager_pending = pending
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
                self._append(seq, new, new_lps)
            else:
                seq.num_computed += len(fed)
                tok, lp = sampled[r - 1]
                self._append(seq, [tok], None if lp is None else [lp])
            self.bm.register(seq)
        self._done(plan)

    def _forward(self, plan) -> torch.Tensor:
        """The logits of the rows the plan samples: a lone prompt's captured step, or the graph."""
        items, want = [], []
        for seq, toks, nl in plan:
            items.append((seq, toks) if self.kivi else (seq.block_table, seq.num_computed, toks))
            want.append(nl)
        logits = self.steps.run(items, want) if self.steps is not None else None
        if logits is None:
            step_inputs = build_kivi_step if self.kivi else build_sla_step if self.sla else build_step
            ids, pos, ctx = step_inputs(self.cache, items, want, self.device)
            logits = self.gm(ids, pos, ctx)[0]
            if self.sla:  # the states after the step are where the forward wrote them
                ctx.commit()
            if self.kivi:
                for seq, _, _ in plan:
                    self.bm.release_aged(seq)
            if not getattr(self.gm, "selects_rows", False):
                logits = logits.index_select(0, ctx.logits_indices)
        return logits

    def _sample(self, logits, plan, proposals):
        """(logits rows, their sequences, next tokens on the device, per-row (logprob, top
        pairs) or None when no row wants them) for the rows that end a sequence's input without
        speculation, drawn in one batched call (seeded by request and position, as the decode
        steps draw); no host sync unless logprobs are wanted."""
        rows, seqs, r = [], [], 0
        for seq, toks, nl in plan:
            r += nl
            if nl == 1 and not (seq.id in proposals and len(toks) > 1):
                rows.append(r - 1)
                seqs.append(seq)
        if not rows:
            return rows, seqs, None, None
        dev = logits.device

        def h2d(x, dt):  # torch.tensor(x, device=cuda) copies and then syncs the stream, which
            # would wait for the forward just launched (the held step is read meanwhile)
            return torch.tensor(x, dtype=dt).to(dev, non_blocking=True)
        ps = [s.params for s in seqs]
        sel = logits.index_select(0, h2d(rows, torch.int64))
        toks = sample_rows(
            sel,
            h2d([p.temperature for p in ps], torch.float32),
            h2d([p.top_k for p in ps], torch.int64),
            h2d([p.top_p for p in ps], torch.float32),
            h2d([s.seed for s in seqs], torch.int64),
            h2d([len(s.token_ids) for s in seqs], torch.int64),
            sample_mode(ps))
        top = logprobs_wanted(ps)
        return rows, seqs, toks, (lp_pairs(*token_logprobs(sel, toks, top)) if top >= 0 else None)

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

    def _apply(self, held: HeldStep) -> None:
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
                    self._append(seq, [toks[held.rows[r - 1]]])
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
        # Adapt k per sequence: lengthen after a full acceptance, shorten after a full rejection.
        if accepted == k:
            seq.spec_k = min(self.k_max, seq.spec_k + 1)
        elif accepted == 0:
            seq.spec_k = max(1, seq.spec_k - 1)
