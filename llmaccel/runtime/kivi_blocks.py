"""Block manager for KIVI-quantized graphs: a full-precision pool and a packed pool.

Blocks hold G tokens (G = the spec's key group), so one packed block is exactly one key group.
A sequence's block table lists, by logical block, first its packed blocks (`seq.kivi_nq` of
them: the tokens old enough to be quantized) and then its full-precision ones (the residual
window and the group being filled). As tokens age, a block moves from the fp pool to the
packed pool: the step that quantizes it reads the old fp block (`seq.kivi_fp_old`, logical
index -> fp id) and writes a new packed one; the fp block is freed after the step.

When tokens are quantized follows the reference executor's QuantizedKVCache exactly, so that
outputs match it token for token. The reference prefills the whole prompt in one forward and
then decodes one token per forward, quantizing before it attends; so the query at position p
sees the first `query_boundary(p)` tokens dequantized and the rest in full precision:

    query_boundary(p) = G * floor(max(0, max(p + 1, n_prompt) - R) / G)

(`quantized_len` of the cache length when the reference ran that query). This holds for any
chunking of the paged runtime (chunked prefill, recompute after preemption) provided every
chunk that does not reach the end of the tokens ends on a group boundary: a quantized group's
scales depend on all G of its tokens. Prefix caching is off: a block's content depends on
the boundary, not only on its tokens.
"""
from __future__ import annotations

from collections import deque


def query_boundary(p: int, n_prompt: int, group: int, residual: int) -> int:
    """Tokens the query at position p sees dequantized (the rest of keys <= p: full precision)."""
    return group * (max(0, max(p + 1, n_prompt) - residual) // group)


def stored_quantized(n: int, n_prompt: int, group: int, residual: int) -> int:
    """Tokens held packed once n are computed: every later query sees them dequantized, and
    their groups are complete."""
    if n == 0:
        return 0
    return min(query_boundary(n - 1, n_prompt, group, residual), group * (n // group))


class KiviBlockManager:
    """Same interface as BlockManager (the scheduler drives both), with two free lists."""

    prefix_caching = False

    def __init__(self, num_fp: int, num_packed: int, group: int, residual: int):
        self.block_size = self.chunk_unit = group
        self.residual = residual
        self.num_fp, self.num_packed = num_fp, num_packed
        self.num_blocks = num_fp + num_packed
        self.free_fp = deque(range(num_fp))
        self.free_packed = deque(range(num_packed))
        self.copies: list[tuple[int, int]] = []  # never any: no block is shared
        self.hit_tokens = 0
        # Largest sequence one request may reach: its packed part must fit the packed pool.
        self.capacity = num_packed * group + residual

    @property
    def num_free(self) -> int:
        return len(self.free_fp) + len(self.free_packed)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def fp_used(self) -> int:
        return self.num_fp - len(self.free_fp)

    @property
    def packed_used(self) -> int:
        return self.num_packed - len(self.free_packed)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _need(self, seq, end: int) -> tuple[int, int, int]:
        """(packed blocks after the step, new packed blocks, new fp blocks) to compute up to end."""
        g = self.block_size
        nq = stored_quantized(end, seq.n_prompt, g, self.residual) // g
        have = len(seq.block_table)
        return nq, nq - seq.kivi_nq, max(0, self.blocks_for(end) - max(nq, have))

    def holds(self, n_tokens: int, n_prompt: int) -> bool:
        """Whether one sequence of n_tokens fits the whole cache (its fp part never exceeds
        R/G + 1 blocks, which the fp pool always has)."""
        return stored_quantized(n_tokens, n_prompt, self.block_size, self.residual) \
            <= self.num_packed * self.block_size

    def can_grow(self, seq, n_tokens: int) -> bool:
        _, nq_new, nf_new = self._need(seq, n_tokens)
        return nq_new <= len(self.free_packed) and nf_new <= len(self.free_fp)

    def grow(self, seq, n_tokens: int) -> bool:
        """Lay the table out for computing up to n_tokens; False (nothing taken) if blocks run out."""
        if not self.can_grow(seq, n_tokens):
            return False
        nq, _, _ = self._need(seq, n_tokens)
        table = seq.block_table
        seq.kivi_q0 = seq.kivi_nq
        for i in range(seq.kivi_nq, nq):  # groups that age in this step
            pid = self.free_packed.popleft()
            if i < len(table):
                seq.kivi_fp_old[i] = table[i]
                table[i] = pid
            else:
                table.append(pid)
        seq.kivi_nq = nq
        while len(table) < self.blocks_for(n_tokens):
            table.append(self.free_fp.popleft())
        return True

    def room(self, seq) -> int:
        """Tokens the sequence could feed now (a group-aligned chunk, or all that is left)."""
        g, nc, total = self.block_size, seq.num_computed, len(seq.token_ids)
        best, end = 0, (nc // g + 1) * g
        while True:
            end = min(end, total)
            if not self.can_grow(seq, end):
                return best
            best = end - nc
            if end == total:
                return best
            end += g

    def release_aged(self, seq) -> None:
        """After the step: the fp blocks whose tokens are now packed go back to the pool."""
        self.free_fp.extend(seq.kivi_fp_old.values())
        seq.kivi_fp_old.clear()
        seq.kivi_q0 = seq.kivi_nq

    def make_writable(self, seq, start: int, end: int) -> bool:
        return True

    def match_prefix(self, seq) -> int:
        seq.hashed_blocks = 0
        return 0

    def register(self, seq) -> None:
        pass

    def trim(self, seq, n_tokens: int) -> None:
        raise NotImplementedError("a KIVI cache never rolls back (speculative decoding is refused)")

    def free_seq(self, seq) -> None:
        for i, bid in enumerate(seq.block_table):
            (self.free_packed if i < seq.kivi_nq else self.free_fp).append(bid)
        self.release_aged(seq)
        seq.block_table = []
        seq.kivi_nq = seq.kivi_q0 = 0
        seq.hashed_blocks = 0
