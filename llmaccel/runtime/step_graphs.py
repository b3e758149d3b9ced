"""Small prefill steps replayed as CUDA graphs.

Run eagerly, a step's forward is Python through the graph and some 650 launches for llama-1b:
~16 ms of host time for 2.3 ms of GPU work at a 128-token prompt, which is most of the time to
the first token of a short request. A step of at most `max_tokens` tokens over at most
`max_seqs` sequences (default: one, a lone request's prefill), each wanting the logits of its
last token at most (no speculative verification), runs instead on the static buffers of a
bucket shape and replays the graph captured for it:

- tokens padded to 16 * 2^k; the spare tokens form one padding sequence on the scratch block
  (token 0 at position 0, slots inside the scratch block), whose outputs are discarded;
- sequences padded to 1, 2, 4 or 8; the spare ones are empty (no tokens, no context);
- block tables padded to a power of two >= 8 blocks with the scratch block.

Every sequence goes through the varlen prefill attention (a decode row of a mixed step is a
sequence of one token), with the bucket's token count as its maximum query length (programs
past a sequence's tokens exit at once). The logits of spare rows read row 0 and are cut off.

Why one sequence by default: under a server's burst (256 requests arriving over a second),
steps of a few new prompts mixed with running rows of growing contexts meet many shapes, and
each first use is an eager run plus a capture (with up to 8 sequences and no warm-up the
server's throughput fell to 0.17x the offline one on an H200, its first steps holding the
requests' headers for 14 s; 8 sequences after LLM.warmup are not measured). At most `max_graphs` shapes are
captured; steps of other shapes then run eagerly.

Without capture (the CPU, tests) the same padded step runs eagerly on the same buffers.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from llmaccel.runtime.kv_cache import PagedContext, PagedKVCache, used_blocks

MAX_TOKENS = 512  # past this a step is GPU-bound: the host's time hides behind its kernels
SEQ_BUCKETS = (1, 2, 4, 8)
MAX_GRAPHS = 32  # captured shapes (each holds a graph and its buffers)
MIN_TOKENS = 16
MIN_WIDTH = 8  # blocks per table row in the narrowest graph (the decode graphs' too)


def pow2_at_least(n: int, lo: int) -> int:
    """The smallest lo * 2^k that is at least n."""
    b = lo
    while b < n:
        b *= 2
    return b


def cuda_graph(fn, pool, device, reset=None) -> torch.cuda.CUDAGraph:
    """fn() captured as a CUDA graph in `pool`, after one warm-up run on a side stream (Triton
    and Inductor compile there, outside the capture); reset() runs between the two."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    if reset is not None:
        reset()
    g = torch.cuda.CUDAGraph()
    # thread_local: a capture forbids unsafe CUDA calls on its own thread only, so another
    # thread's work (a heal training beside the engine that samples its windows) goes on
    with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
        fn()
    return g


class _StepBuffers:
    """The static inputs of one (tokens, sequences, width) shape, and its logits once run."""

    def __init__(self, N: int, S: int, W: int, device):
        z = dict(device=device)
        self.ids = torch.zeros(1, N, dtype=torch.int64, **z)
        self.pos = torch.zeros(1, N, dtype=torch.int64, **z)
        self.slots = torch.zeros(N, dtype=torch.int64, **z)
        self.tables = torch.zeros(S, W, dtype=torch.int32, **z)
        self.lens = torch.zeros(S, dtype=torch.int32, **z)
        self.cu = torch.zeros(S + 1, dtype=torch.int32, **z)
        self.rows = torch.zeros(S, dtype=torch.int64, **z)
        self.logits = None


class StepGraphs:
    """Small steps of the runtime graph `gm` (a selects_rows graph: its LM head runs on
    ctx.logits_indices only) over `cache`, whose block `scratch` no sequence holds."""

    def __init__(self, gm: torch.fx.GraphModule, cache: PagedKVCache, *, scratch: int,
                 capture: bool, pool=None, max_tokens: int = MAX_TOKENS, max_seqs: int = 1,
                 max_graphs: int = MAX_GRAPHS):
        self.gm, self.cache, self.scratch, self.capture = gm, cache, scratch, capture
        self.max_tokens, self.max_seqs, self.max_graphs = max_tokens, min(max_seqs, SEQ_BUCKETS[-1]), max_graphs
        self.device = cache.device
        self.pool = pool  # the decode graphs' pool: one replays at a time
        self.graphs: dict[tuple[int, int, int], tuple] = {}
        self.failures: dict[tuple, str] = {}  # shapes whose capture failed: why
        self.replays = 0
        self.capture_s = 0.0  # seconds in first uses of shapes: eager runs and captures

    def shape(self, items, want) -> tuple[int, int, int] | None:
        """The bucket (tokens, sequences, width) of a step, or None when it is not small."""
        if len(items) > self.max_seqs or any(w > 1 for w in want):
            return None
        n = sum(len(toks) for _, _, toks in items)
        N = pow2_at_least(n, MIN_TOKENS)
        if N > self.max_tokens:
            return None
        S = next((s for s in SEQ_BUCKETS if s >= len(items) + (N > n)), None)
        if S is None:
            return None
        bs = self.cache.block_size
        _, width = used_blocks([t for t, _, _ in items], [st + len(tk) for t, st, tk in items], bs)
        # the padding sequence's context (up to N - 1 tokens) lies in its table too
        return N, S, pow2_at_least(max(width, -(-N // bs)), MIN_WIDTH)

    def run(self, items, want) -> torch.Tensor | None:
        """The logits (one row per item with want 1, in order) of a step over items =
        (block_table, start position, new token ids), or None when no bucket takes it."""
        key = self.shape(items, want)
        if key is None or (key not in self.graphs and len(self.graphs) >= self.max_graphs):
            return None
        g, buf, fn = self.graph(key)
        self._fill(buf, items, want)
        if g is None:
            fn()
        else:
            g.replay()
            self.replays += 1
        return buf.logits[: sum(want)]

    def warm_keys(self) -> list[tuple[int, int, int]]:
        """A lone prompt's shapes from position 0 of every token bucket (its tokens filling the
        bucket or not), largest first: what LLM.warmup captures."""
        bs, keys, N = self.cache.block_size, [], MIN_TOKENS
        while N <= self.max_tokens and len(keys) + 2 <= self.max_graphs:
            W = pow2_at_least(-(-N // bs), MIN_WIDTH)
            keys += [(N, 1, W), (N, 2, W)]
            N *= 2
        return keys[::-1]

    def graph(self, key):
        """The graph, buffers and step of a (tokens, sequences, width) shape, captured on first use."""
        hit = self.graphs.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        N, S, W = key
        buf = _StepBuffers(N, S, W, self.device)
        self._fill(buf, [], [])  # a valid step of padding only, for the warm-up

        def fn():
            ctx = PagedContext(self.cache, 0, buf.slots, buf.tables, buf.lens, buf.cu, N, buf.rows)
            buf.logits = self.gm(buf.ids, buf.pos, ctx)[0]

        hit = (None, buf, fn)
        if self.capture:
            try:
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                hit = (cuda_graph(fn, self.pool, self.device), buf, fn)
            except Exception as e:  # noqa: BLE001 - this shape runs eagerly, the rest still replay
                self.failures[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                warnings.warn(f"steps of {N} tokens run eagerly: capturing them failed "
                              f"({self.failures[key]})")
        self.graphs[key] = hit
        self.capture_s += time.perf_counter() - t0
        return hit

    def _fill(self, buf: _StepBuffers, items, want) -> None:
        """Sequences 0 .. len(items) - 1 from the step, then the padding sequence, then empty
        ones: one host array per buffer, copied without waiting."""
        N, (S, W), bs = buf.ids.shape[1], buf.tables.shape, self.cache.block_size
        ids = np.zeros(N, dtype=np.int64)
        pos = np.zeros(N, dtype=np.int64)
        slots = np.zeros(N, dtype=np.int64)
        tables = np.full((S, W), self.scratch, dtype=np.int32)
        lens = np.zeros(S, dtype=np.int32)
        cu = np.zeros(S + 1, dtype=np.int32)
        rows = np.zeros(S, dtype=np.int64)
        t = r = 0
        for i, ((table, start, toks), nl) in enumerate(zip(items, want)):
            T = len(toks)
            p = np.arange(start, start + T)
            ids[t: t + T] = toks
            pos[t: t + T] = p
            used = table[: -(-(start + T) // bs)]
            slots[t: t + T] = np.asarray(used, dtype=np.int64)[p // bs] * bs + p % bs
            tables[i, : len(used)] = used
            lens[i] = start + T
            t += T
            cu[i + 1] = t
            if nl:
                rows[r] = t - 1
                r += 1
        s = len(items)
        if t < N:  # the padding sequence: token 0 at position 0 (within any position table;
            # its causal order comes from cu_seqlens and its context length), in the scratch block
            slots[t:] = self.scratch * bs + np.arange(N - t) % bs
            lens[s] = N - t
            s += 1
        cu[s:] = N
        for dst, src in ((buf.ids[0], ids), (buf.pos[0], pos), (buf.slots, slots), (buf.tables, tables),
                         (buf.lens, lens), (buf.cu, cu), (buf.rows, rows)):
            dst.copy_(torch.from_numpy(src), non_blocking=True)
