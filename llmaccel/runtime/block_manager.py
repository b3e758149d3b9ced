"""Block manager: fixed-size KV blocks, a free list, reference counts and prefix caching.

A sequence owns a block table (list of block ids); token position p lives in block
table[p // block_size] at offset p % block_size. A block that is full and whose KV has been
computed is registered under a hash of (hash of the previous block, its token ids), so a later
sequence with the same prefix reuses it (reference count + 1) instead of recomputing it. Freed
blocks keep their hash while they sit in the free list and are reused least recently freed first,
so a prefix can be found again until its blocks are actually overwritten. A write into a block
that another sequence also holds copies it first (copy on write).
"""
from __future__ import annotations

from collections import OrderedDict


class Block:
    __slots__ = ("id", "ref", "hash", "tokens")

    def __init__(self, i: int):
        self.id, self.ref, self.hash, self.tokens = i, 0, None, None


def block_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.copies: list[tuple[int, int]] = []  # (src, dst) copies the KV cache must perform
        self.hit_tokens = 0
        self.capacity = num_blocks * block_size
        self.chunk_unit = 1  # a prefill chunk may end anywhere

    def holds(self, n_tokens: int, n_prompt: int) -> bool:
        """Whether one sequence of n_tokens fits the whole cache."""
        return n_tokens <= self.capacity

    def room(self, seq) -> int:
        """Tokens the sequence could feed now with its own blocks plus all free ones."""
        return (len(seq.block_table) + self.num_free) * self.block_size - seq.num_computed

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _take(self) -> int:
        bid, _ = self.free.popitem(last=False)
        b = self.blocks[bid]
        if b.hash is not None and self.cached.get(b.hash) == bid:
            del self.cached[b.hash]
        b.hash, b.tokens, b.ref = None, None, 1
        return bid

    def _release(self, bid: int) -> None:
        b = self.blocks[bid]
        b.ref -= 1
        if b.ref == 0:
            self.free[bid] = None

    def match_prefix(self, seq) -> int:
        """Attach cached blocks for the longest cached full-block prefix; returns tokens covered.

        At most len - 1 tokens are taken from the cache, so the last prompt token is always
        computed (its logits give the first new token).
        """
        if not self.prefix_caching or seq.block_table:
            return 0
        bs, toks, prev = self.block_size, seq.token_ids, None
        n_full = (len(toks) - 1) // bs
        for i in range(n_full):
            chunk = tuple(toks[i * bs: (i + 1) * bs])
            h = block_hash(prev, chunk)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].tokens != chunk:
                break
            b = self.blocks[bid]
            if b.ref == 0:
                del self.free[bid]
            b.ref += 1
            seq.block_table.append(bid)
            prev = h
        seq.hashed_blocks = len(seq.block_table)
        n = len(seq.block_table) * bs
        self.hit_tokens += n
        return n

    def can_grow(self, seq, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq, n_tokens: int) -> bool:
        """Make the block table cover n_tokens positions; False (nothing taken) if blocks run out."""
        need = self.blocks_for(n_tokens) - len(seq.block_table)
        if need > self.num_free:
            return False
        for _ in range(max(0, need)):
            seq.block_table.append(self._take())
        return True

    def make_writable(self, seq, start: int, end: int) -> bool:
        """Copy on write: blocks holding positions [start, end) must be this sequence's alone."""
        bs = self.block_size
        for i in range(start // bs, min(self.blocks_for(end), len(seq.block_table))):
            bid = seq.block_table[i]
            b = self.blocks[bid]
            if b.ref > 1:
                if not self.free:
                    return False
                new = self._take()
                self.copies.append((bid, new))
                b.ref -= 1
                seq.block_table[i] = new
            elif b.hash is not None:
                # Sole owner rewriting a registered block: its content may change, so unregister.
                if self.cached.get(b.hash) == bid:
                    del self.cached[b.hash]
                b.hash, b.tokens = None, None
        return True

    def trim(self, seq, n_tokens: int) -> None:
        """Release blocks beyond those n_tokens positions need (speculative rollback)."""
        keep = self.blocks_for(n_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free_seq(self, seq) -> None:
        for bid in reversed(seq.block_table):
            self._release(bid)
        seq.block_table = []
        seq.hashed_blocks = 0

    def register(self, seq) -> None:
        """Register the sequence's full blocks whose KV is computed, for reuse by later prompts."""
        if not self.prefix_caching:
            return
        bs, toks = self.block_size, seq.token_ids
        n_full = min(seq.num_computed // bs, len(seq.block_table))
        prev = self.blocks[seq.block_table[seq.hashed_blocks - 1]].hash if seq.hashed_blocks else None
        for i in range(seq.hashed_blocks, n_full):
            chunk = tuple(toks[i * bs: (i + 1) * bs])
            h = block_hash(prev, chunk)
            b = self.blocks[seq.block_table[i]]
            if b.hash is None:
                b.hash, b.tokens = h, chunk
                self.cached.setdefault(h, b.id)
            prev = b.hash
        seq.hashed_blocks = max(seq.hashed_blocks, n_full)
