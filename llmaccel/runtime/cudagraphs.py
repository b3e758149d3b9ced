"""The runtime's decode steps replayed as CUDA graphs, one per (batch bucket, block-table width).

A step in which every scheduled sequence feeds one token (no prefill chunk, no speculation) is
padded to the next batch bucket (1, 2, 4, 8, 16, then multiples of 16 up to max_num_seqs) and
its block tables to the next power-of-two width; the inputs are copied into static buffers and
the graph of that shape replays the whole forward (the paged decode kernel's split count
depends on those two sizes only, never on the lengths in the tables). Other steps run eagerly.

Padding rows feed token 0 at position 0 and write their k, v into a scratch block that the
block manager never hands out (the cache has one block more than it manages); each attends over
that one slot, so its (discarded) output stays finite. The graph's forward is the runtime graph
lowered with `select="none"`: only RoPE changes, to a lookup in cos / sin tables built once on
the device (the op builds its frequencies on the host at each call, a copy a graph cannot hold),
the same values as the op.

Without capture (`capture=False`, the CPU) the same padded buffers are fed to the forward
directly: what the tests check there is the padding and the bookkeeping.
"""
from __future__ import annotations

import torch

from llmaccel.codegen.lower import lower
from llmaccel.runtime.kv_cache import PagedContext, PagedKVCache, slot, table_tensor, used_blocks

MIN_WIDTH = 8  # blocks per table row in the narrowest graph


def batch_buckets(max_seqs: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_seqs]
    out += list(range(16, max_seqs, 16))
    return out + [max_seqs]


class DecodeGraphs:
    """Decode forwards of `gm` (the runtime graph) over `cache`, whose last block is the
    scratch block of the padding rows."""

    def __init__(self, gm: torch.fx.GraphModule, cache: PagedKVCache, *, max_seqs: int,
                 max_blocks: int, max_len: int, capture: bool):
        self.cache, self.capture = cache, capture
        self.buckets = batch_buckets(max_seqs)
        self.max_blocks = max_blocks
        self.scratch = cache.num_blocks - 1
        self.gm, _ = lower(gm, max_len=max_len, select="none")
        self.device = next(iter(cache.k.values())).device
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0

    def bucket(self, n: int, width: int) -> tuple[int, int] | None:
        """The (batch, width) graph that takes n sequences of tables up to width blocks."""
        b = next((b for b in self.buckets if b >= n), None)
        if b is None:
            return None
        w = MIN_WIDTH
        while w < width:
            w *= 2
        return b, min(w, max(self.max_blocks, width))

    def _buffers(self, B: int, W: int) -> dict[str, torch.Tensor]:
        dev = self.device
        return dict(ids=torch.zeros(1, B, dtype=torch.int64, device=dev),
                    pos=torch.zeros(1, B, dtype=torch.int64, device=dev),
                    slots=torch.zeros(B, dtype=torch.int64, device=dev),
                    tables=torch.zeros(B, W, dtype=torch.int32, device=dev),
                    lens=torch.ones(B, dtype=torch.int32, device=dev),
                    cu=torch.zeros(1, dtype=torch.int32, device=dev),
                    rows=torch.arange(B, dtype=torch.int64, device=dev))

    def _forward(self, buf):
        ctx = PagedContext(self.cache, buf["ids"].shape[1], buf["slots"], buf["tables"], buf["lens"],
                           buf["cu"], 0, buf["rows"])
        return self.gm(buf["ids"], buf["pos"], ctx)[0]

    def _graph(self, key):
        hit = self.graphs.get(key)
        if hit is not None:
            return hit
        buf = self._buffers(*key)
        self._fill(buf, [], [], [], [])  # every row a padding row: harmless to run
        if not self.capture:
            hit = (None, buf, None)
        else:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up outside the capture (Triton compiles here)
                self._forward(buf)
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._forward(buf)
            hit = (g, buf, out)
        self.graphs[key] = hit
        return hit

    def _fill(self, buf, ids, pos, tables, lens) -> None:
        """Rows 0 .. n - 1 from the step, the rest padding rows on the scratch block."""
        n, (B, W) = len(ids), buf["tables"].shape
        bs = self.cache.block_size
        pad = B - n
        t = table_tensor(list(tables) + [[self.scratch]] * pad, W)
        slots = [slot(table, p, bs) for table, p in zip(tables, pos)]
        buf["ids"].copy_(torch.tensor([list(ids) + [0] * pad], dtype=torch.int64), non_blocking=True)
        buf["pos"].copy_(torch.tensor([list(pos) + [0] * pad], dtype=torch.int64), non_blocking=True)
        buf["slots"].copy_(torch.tensor(slots + [self.scratch * bs] * pad, dtype=torch.int64),
                           non_blocking=True)
        buf["lens"].copy_(torch.tensor(list(lens) + [1] * pad, dtype=torch.int32), non_blocking=True)
        buf["tables"].copy_(t, non_blocking=True)

    def run(self, items: list[tuple[list[int], int, int]]) -> torch.Tensor | None:
        """Logits (n, vocab) of a decode step over items = (block_table, position, token), or
        None when no graph takes it (too many sequences); valid until the next call."""
        lens = [p + 1 for _, p, _ in items]
        tables, width = used_blocks([table for table, _, _ in items], lens, self.cache.block_size)
        key = self.bucket(len(items), width)
        if key is None:
            return None
        g, buf, out = self._graph(key)
        self._fill(buf, [t for _, _, t in items], [p for _, p, _ in items], tables, lens)
        if g is None:
            out = self._forward(buf)
        else:
            g.replay()
        self.replays += 1
        return out[:len(items)]
