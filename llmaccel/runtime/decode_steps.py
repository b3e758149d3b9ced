"""The engine core's decode-only steps on the DecodeRunner: a group of up to MAX_STEPS sub-steps,
and the next group launched before the bookkeeping of the one just read (docs/runtime.md)."""
from __future__ import annotations

from llmaccel.runtime.decode import MAX_STEPS
from llmaccel.runtime.sequence import Sequence
from llmaccel.sampling import logprobs_wanted, sample_mode


class DecodeSteps:
    """The decode steps of an engine core (core.py): they read its block manager, scheduler,
    backend, decode runner and statistics, and apply tokens with its `append`. `pending`: (rows,
    the decode group launched for them) that the next step resolves."""

    def __init__(self, core):
        self.core, self.bm, self.sched, self.backend = core, core.bm, core.sched, core.backend
        self.runner, self.stats = core.runner.decode, core.stats
        self.pending = None

    def run(self, seqs: list[Sequence]) -> bool:
        """A decode-only step on the runner: up to MAX_STEPS sub-steps, as many as the row with
        the most tokens left wants (a row that reaches max_tokens earlier computes the rest of
        the group and discards it, as after an EOS: a row of a wide batch costs little, a host
        sync per finishing row costs a step), within every row's context and the free blocks.
        False when no shape takes it (the step runs eagerly)."""
        n = max(1, self._group_size(seqs, 0))
        if not self._reserve(seqs, n):
            n = 1  # the scheduler made room for one token per row
            self._reserve(seqs, n)
        bm = self.bm
        tables = self.backend.runner_tables(seqs, 0)
        rows = [(t, s.num_computed, s.token_ids[-1], s.params.temperature, s.params.top_k,
                 s.params.top_p, s.seed) for s, t in zip(seqs, tables)]
        ps = [s.params for s in seqs]
        try:
            grp = self.runner.launch(rows, n, sample_mode(ps), logprobs_wanted(ps))
        except BaseException:
            self.backend.lost(seqs, self.sched)
            raise
        if grp is None:
            for seq in seqs:
                bm.trim(seq, seq.num_computed + 1)
            return False
        self.backend.launched(seqs, tables, 0, n)
        self.resolve(seqs, grp)
        return True

    def resolve(self, seqs: list[Sequence], grp) -> None:
        """Launch the next decode group for the same rows where nothing else waits (so the GPU
        computes it while the host does this group's bookkeeping and the caller its own work:
        the next step() resolves it), wait for this group, then apply its tokens to the rows
        still running. The next group is launched before the wait where the runner copies
        each group's outputs apart (`early`: the GPU goes from one group to the next without
        waiting for the host), else after it."""
        try:
            self._apply_group(seqs, grp)
        except BaseException:
            self.backend.lost(seqs, self.sched)
            raise

    def _apply_group(self, seqs: list[Sequence], grp) -> None:
        early = self.runner.early
        nxt = self._continue(seqs, grp) if early else None
        toks_all, lps_all = self.runner.collect(grp)
        if not early:
            nxt = self._continue(seqs, grp)
        n, bm = grp.n, self.bm
        self.stats["decode_steps"] += n
        self.stats["decode_row_steps"] += n * sum(1 for e in grp.ends if e)  # rows made padding: 0
        # the next group goes on from these tokens: it is kept only if all of them are applied
        # (a failure here leaves the rows' host state behind the device's; the next step then
        # launches from the host state again)
        for i, (seq, toks) in enumerate(zip(seqs, toks_all)):
            if seq.finished:  # aborted, or ended by the group before: its tokens are dropped
                continue
            seq.num_computed += n
            self.core.append(seq, toks, lps_all[i] if lps_all is not None else None)
            bm.register(seq)
            if seq.finished:
                self.sched.finish(seq)
        self.stats["kv_blocks_peak"] = max(self.stats["kv_blocks_peak"], bm.num_used)
        self.pending = nxt

    def _continue(self, seqs: list[Sequence], grp):
        """(seqs, the next group launched) when the next step would decode the same rows: no
        waiting request could be admitted now, no draft would propose, a row has tokens left after this
        group, and blocks are free for the next positions; else None. A row that ends within this group (an EOS, a
        stop string: not known yet) computes the next group for nothing, as after an EOS inside
        a group; a row known to end (max_tokens, abort) becomes a padding row."""
        if self.bm.copies or self.core.draft is not None or self._admissible():
            return None  # the next step copies blocks, lets the draft propose, or admits
        rows = {id(s) for s in seqs}
        if any(id(s) not in rows for s in self.sched.running):
            return None  # a running sequence outside the group (one whose token an eager step
            # read after the group was scheduled) waits for no more than this group
        k, bm = grp.n, self.bm
        cont = [s for s in seqs if not s.finished and min(self._left(s)) > k]
        if not cont:
            return None
        n = self._group_size(cont, k)
        if not self._reserve(cont, k + n):
            return None
        tables = self.backend.runner_tables(cont, k)
        by_seq = dict(zip(map(id, cont), tables))
        nxt = self.runner.relaunch(grp, [by_seq.get(id(s)) for s in seqs], n)
        if nxt is None:
            for s in cont:
                bm.trim(s, s.num_computed + k)
            return None
        self.backend.launched(cont, tables, k, n)
        return seqs, nxt

    def _reserve(self, seqs: list[Sequence], ahead: int) -> bool:
        """Grow each row's block table to its position + `ahead` tokens (blocks that only this
        row holds) when the free blocks cover them all; False (nothing grown) when they do not."""
        bm = self.bm
        short = [(s, bm.blocks_for(s.num_computed + ahead) - len(s.block_table)) for s in seqs]
        short = [(s, n) for s, n in short if n > 0]   # most groups grow few rows, if any
        if sum(n for _, n in short) > bm.num_free:
            return False
        for s, _ in short:
            bm.grow(s, s.num_computed + ahead)
        return True

    def _admissible(self) -> bool:
        """Whether the scheduler would admit the first waiting request now (a free sequence slot
        and blocks for its tokens): then the next step schedules instead of decoding on. A
        saturated engine (every slot taken) keeps its groups overlapped."""
        w = self.sched.waiting
        return bool(w) and len(self.sched.running) < self.sched.max_num_seqs and \
            self.bm.blocks_for(len(w[0].token_ids)) <= self.bm.num_free

    def _group_size(self, seqs: list[Sequence], ahead: int) -> int:
        """Sub-steps of a group for these rows once `ahead` more tokens are computed: as many as
        the row with the most tokens left wants, within every row's context, at most MAX_STEPS
        (<= 0: none is left)."""
        left = [self._left(s) for s in seqs]
        return min(MAX_STEPS, max(t for t, _ in left) - ahead, min(c for _, c in left) - ahead)

    def _left(self, s: Sequence) -> tuple[int, int]:
        """(tokens s may still emit, positions left in the model's context)."""
        return s.params.max_tokens - s.n_output, self.core.cfg.max_position - len(s.token_ids)
