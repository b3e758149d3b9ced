"""The runtime's decode steps: the lowered graph, sampling inside, several steps per host sync.

A step in which every scheduled sequence feeds one token (no prefill chunk, no speculation) runs
here. Its rows are padded to a batch bucket (1, 2, 4, 8, 16, then multiples of 16 up to
max_num_seqs) and its block tables to a power-of-two width; the last tokens, positions, tables
and per-row sampling parameters are copied into static buffers, and one sub-step

    logits = forward(tokens at positions)      # lowered graph: the project's kernels
    next = sample_rows(logits, ...)            # greedy / temperature / top-k / top-p, seeded
    out[:, i] = next; tokens = next; positions += 1

is replayed n times back to back (a CUDA graph per (bucket, width, sampling mode) on CUDA), the
KV slot of each row computed on the device from its block table and position. The host reads
the n x rows new tokens once, then applies EOS, stop strings and max_tokens: a row that ended
early wasted at most n - 1 sub-steps; its extra KV entries lie past what it keeps. `relaunch`
starts the next group of the same rows from the device state the last one left (the engine
does so before its bookkeeping of the tokens just read: docs/runtime.md).

The forward is the IR graph lowered with select="all": custom ops for every op a kernel module
registers; RoPE, the KV write and the attention of a layer in one kernel
(llmaccel::paged_rope_decode_attention, where `fuse_rope` finds the pattern); at one row on CUDA each linear is a fused GEMV (norm prologue, SiLU-mul / residual
epilogues, int4 codes read in registers for `quant` graphs), at more rows GEMMs. On CUDA the
sub-step's forward is compiled by Inductor (the glue between kernels fused) before capture; the
sampler (its Triton kernel, llmaccel/sampling.py) and the state update run uncompiled inside the
same graph. Padding rows
feed token 0 at position 0 over a table of the scratch block, which the block manager never
hands out; their outputs are discarded.

Without capture (the CPU) the same sub-step runs eagerly on the same buffers.
"""
from __future__ import annotations

import functools
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from llmaccel.kernels.paged_rope import paged_rope_decode_cpu, paged_rope_decode_masked, slots_of  # also registers llmaccel::paged_rope_decode_attention
from llmaccel.codegen.kernel_ops import load_kernel_modules
from llmaccel.codegen.lower import lower
from llmaccel.codegen.rope import fuse_rope
from llmaccel.ops.context import StepContext
from llmaccel.runtime.kv_cache import PagedKVCache, used_blocks
from llmaccel.runtime.step_graphs import MIN_WIDTH, cuda_graph, pow2_at_least
from llmaccel.sampling import logprob_pairs, sample_rows, token_logprobs

MAX_STEPS = 8  # sub-steps per host sync: the tokens a finished row may waste, a stream's granularity


def cpu_compiler() -> str | None:
    """None where Inductor finds a C++ compiler to build CPU kernels with and
    LLMACCEL_CPU_COMPILE=0 does not turn it off; else why not."""
    if os.environ.get("LLMACCEL_CPU_COMPILE", "1") == "0":
        return "off: LLMACCEL_CPU_COMPILE=0"
    return _no_cpp_compiler()


@functools.cache
def _no_cpp_compiler() -> str | None:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - no compiler, or an Inductor without the helper
        return f"no C++ compiler for Inductor ({type(e).__name__}: {e})"[:200]
    return None


def default_compile(device) -> bool:
    """compile=None's choice: Inductor on CUDA, and on a CPU where it finds a C++ compiler."""
    return torch.device(device).type == "cuda" or cpu_compiler() is None


def batch_buckets(max_seqs: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_seqs]
    out += list(range(16, max_seqs, 16))
    return out + [max_seqs]


class DecodeContext(StepContext):
    """The attention context of a decode sub-step: one query per row at positions `pos` (B,),
    block tables (B, W); the KV slot and context length of each row come from them."""

    def __init__(self, cache: PagedKVCache, pos: torch.Tensor, tables: torch.Tensor):
        self.cache, self.tables, self.pos = cache, tables, pos

    def attend(self, layer, q, k, v, *, n_heads, n_kv_heads, head_dim, scale, rope=None, kv_dtype=None,
               **_):
        """rope: (cos, sin, positions) when q and k still lack their rotary embedding (graphs
        rewritten by fuse_rope); k = v = None: q is the fused projection."""
        B = q.shape[1]
        kc, vc, ks, vs = self.cache.layer(layer, kv_dtype is not None)
        if rope is not None:  # one launch: RoPE, the KV write and the attention
            if k is None:
                args = (q.reshape(B, n_heads + 2 * n_kv_heads, head_dim), None, None)
            else:
                args = (q.reshape(B, n_heads, head_dim), k.reshape(B, n_kv_heads, head_dim),
                        v.reshape(B, n_kv_heads, head_dim))
            # CPU: plain functions, not the custom op (its dispatch costs more than the attention
            # there): eager steps attend row by row over each row's context; compiled steps trace
            # one masked attention over the tables (no host read of the positions)
            fn = torch.ops.llmaccel.paged_rope_decode_attention
            if q.device.type == "cpu":
                fn = paged_rope_decode_masked if torch.compiler.is_compiling() else paged_rope_decode_cpu
            out = fn(*args, kc, vc, self.pos, self.tables, *rope[:2], k_scale=ks, v_scale=vs, scale=scale)
            return out.reshape(1, B, n_heads * head_dim)
        # graphs without fuse_rope's pattern (GPT-2): the slot and length of each row here
        out = torch.ops.llmaccel.paged_decode_attention(
            q.reshape(B, n_heads, head_dim), k.reshape(B, n_kv_heads, head_dim),
            v.reshape(B, n_kv_heads, head_dim), kc, vc,
            slots_of(self.pos, self.tables, self.cache.block_size), self.tables,
            (self.pos + 1).to(torch.int32), ks, vs, scale=scale)
        return out.reshape(1, B, n_heads * head_dim)


class _Buffers:
    """The static inputs and outputs of one (batch, width) shape."""

    def __init__(self, B: int, W: int, device, top: int = -1):
        z = dict(device=device)
        self.ids = torch.zeros(B, dtype=torch.int64, **z)
        self.pos = torch.zeros(B, dtype=torch.int64, **z)
        self.tables = torch.zeros(B, W, dtype=torch.int32, **z)
        self.temp = torch.zeros(B, dtype=torch.float32, **z)
        self.top_p = torch.ones(B, dtype=torch.float32, **z)
        self.top_k = torch.zeros(B, dtype=torch.int64, **z)
        self.seeds = torch.zeros(B, dtype=torch.int64, **z)
        self.i = torch.zeros(1, dtype=torch.int64, **z)
        self.out = torch.zeros(B, MAX_STEPS, dtype=torch.int64, **z)
        # logprobs (top >= 0): of the sampled tokens, and the `top` most likely tokens'
        self.top = top
        self.lp = torch.zeros(B, MAX_STEPS, dtype=torch.float32, **z) if top >= 0 else None
        self.top_ids = torch.zeros(B, MAX_STEPS, max(top, 0), dtype=torch.int64, **z) if top > 0 else None
        self.top_lp = torch.zeros(B, MAX_STEPS, max(top, 0), dtype=torch.float32, **z) if top > 0 else None
        # host copies of the outputs, two so that a group's copy lands while the host still
        # reads the one before (DecodeRunner.early); made on first use
        self.host: list[dict | None] = [None, None]
        self.slot = 0

    def outputs(self) -> dict[str, torch.Tensor]:
        return {k: t for k, t in (("out", self.out), ("lp", self.lp), ("top_ids", self.top_ids),
                                  ("top_lp", self.top_lp)) if t is not None}


def _forward(gm, context, buf: _Buffers) -> torch.Tensor:
    """Logits (B, V) of the buffers' tokens at their positions; context(pos, tables): the step's
    attention context."""
    B = buf.ids.shape[0]
    ctx = context(buf.pos, buf.tables)
    return gm(buf.ids.view(1, B), buf.pos.view(1, B), ctx)[0]


def _advance(buf: _Buffers, logits: torch.Tensor, mode: str) -> None:
    """Sample the next tokens, record them, and move the rows one position on."""
    nxt = sample_rows(logits, buf.temp, buf.top_k, buf.top_p, buf.seeds, buf.pos + 1, mode)
    buf.out.index_copy_(1, buf.i, nxt[:, None])
    if buf.top >= 0:
        lp, top = token_logprobs(logits, nxt, buf.top)
        buf.lp.index_copy_(1, buf.i, lp[:, None])
        if top is not None:
            buf.top_ids.index_copy_(1, buf.i, top[0][:, None])
            buf.top_lp.index_copy_(1, buf.i, top[1][:, None])
    buf.ids.copy_(nxt)
    buf.pos.add_(1)
    buf.i.add_(1)


def _recompiles_allowed(compiled, freezing: bool = False):
    """compiled, called with Dynamo's recompile limit raised: the forwards of both kinds share
    one code object, hence one count, which shape specializations could push past the default
    limit (8). With `freezing`, Inductor's freezing is on while Dynamo traces (it keeps the
    weights as constants only when it sees the flag then; torch.compile's options reach
    Inductor alone): on the CPU Inductor then prepacks the bf16 linears for oneDNN, SmolLM2
    `fuse` 48-54 tok/s against 33-40 (docs/performance.md, CPU). Scoped to the call, not set
    process-wide."""
    import torch._inductor.config as inductor_config

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"

    def call(buf):
        with cfg.patch(**{name: 256}):
            if not freezing:
                return compiled(buf)
            with inductor_config.patch(freezing=True):
                return compiled(buf)
    return call


@dataclass
class Group:
    """Sub-steps launched on one shape's buffers: `n` of them for the first `n_rows` rows."""
    graph: object  # the CUDA graph, or None (the sub-step runs eagerly)
    buf: _Buffers
    fn: object
    n_rows: int
    n: int
    ends: list[int]  # each row's position after the group (0: a row made padding)
    host: dict | None = None  # its outputs copied to host memory behind it (early), and
    done: object = None       # the event that copy completes (CUDA)


WARM_MODES = ("greedy", "sample", "filter")  # every sampling mode a request can ask for


class DecodeRunner:
    """Decode sub-steps of the IR graph `gm` over `cache`, whose last block is the scratch
    block of the padding rows.

    capture: CUDA graphs (CUDA only); compile: Inductor on the sub-step first (None: default_compile).
    context(cache, pos, tables): a sub-step's attention context (DecodeContext; an sla graph's
    states take SlaDecodeContext, with their scratch entry as `scratch`).
    """

    def __init__(self, gm: torch.fx.GraphModule, cache: PagedKVCache, *, max_seqs: int,
                 max_blocks: int, max_len: int, capture: bool, compile: bool | None = None,
                 context=DecodeContext, scratch: int | None = None):
        self.ir, self.cache, self.capture = gm, cache, capture
        self.context = functools.partial(context, cache)
        self.max_len, self.max_blocks = max_len, max_blocks
        self.buckets = batch_buckets(max_seqs)
        self.scratch = cache.num_blocks - 1 if scratch is None else scratch
        self.device = cache.device
        cuda = self.device.type == "cuda"
        # Inductor on CUDA, and on a CPU whose C++ compiler it finds (the eager CPU step spends
        # ~half its time dispatching small ops: docs/performance.md, CPU)
        self.compile = default_compile(self.device) if compile is None else compile
        self.eager_why = None if self.compile else "compile off" if compile is False else cpu_compiler()
        # one row on CUDA: the fused Triton GEMVs, when their kernel module loads
        self.gemv = cuda and load_kernel_modules().get("gemv") == "ok"
        self.lowered: dict[str, torch.fx.GraphModule] = {}
        self.fns: dict[tuple[str, bool], object] = {}
        self.graphs: dict[tuple[int, int, str, int], tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0
        self.launches = 0    # groups launched from the host's rows
        self.relaunches = 0  # groups launched from the device state of the one before
        self.failures: dict[tuple, str] = {}  # shapes whose capture failed: why
        self.capture_s = 0.0  # seconds in first uses of shapes: compiles and captures
        # early: each group's outputs are copied to host memory behind it, so the next group
        # may be launched before the host reads them (the GPU then never waits for the host
        # between groups). With CUDA graphs, where launching costs the host little; eager
        # sub-steps run as they are launched, and would delay the tokens just computed.
        self.early = capture

    def bucket(self, n: int, width: int) -> tuple[int, int] | None:
        """The (batch, width) shape that takes n rows of tables up to width blocks."""
        b = next((b for b in self.buckets if b >= n), None)
        if b is None:
            return None
        return b, min(pow2_at_least(width, MIN_WIDTH), max(self.max_blocks, width))

    def widths(self) -> list[int]:
        """Every table width a shape can have, widest first."""
        out, w = [], MIN_WIDTH
        while True:
            out.append(min(w, self.max_blocks))  # as bucket(): tables never outgrow max_blocks
            if w >= self.max_blocks:
                return out[::-1]
            w *= 2

    def warm_keys(self, modes, context: int) -> list[tuple]:
        """(batch, width, mode, -1) for every batch bucket and every width that rows of requests
        within `context` tokens take, largest first (a smaller graph reuses the pool's memory
        that a larger one's capture freed): what LLM.warmup captures. A group runs as many sub-steps as the row
        with the most tokens left wants: a row with one token left (at position context - 2)
        has its table grown by up to MAX_STEPS tokens, past the context."""
        top = self.bucket(1, -(-(context - 2 + MAX_STEPS) // self.cache.block_size))[1]
        return [(B, W, m, -1) for m in modes for B in self.buckets[::-1] for W in self.widths() if W <= top]

    def _fn(self, B: int, mode: str, compiled: bool = True):
        """The sub-step: the forward (compiled by Inductor when asked: the glue between kernels
        fused), then the sampler and the state update, uncompiled (captured with it)."""
        kind = "gemv" if B == 1 and self.gemv else "mm"
        compiled = compiled and self.compile
        fwd = self.fns.get((kind, compiled))
        if fwd is None:
            if kind not in self.lowered:
                gm, _ = lower(self.ir, max_len=self.max_len, select="all", linear=kind)
                fuse_rope(gm)  # RoPE into the paged decode attention
                self.lowered[kind] = gm
            fwd = functools.partial(_forward, self.lowered[kind], self.context)
            if compiled:
                fwd = _recompiles_allowed(torch.compile(fwd, fullgraph=True),
                                          freezing=self.device.type == "cpu")
            self.fns[(kind, compiled)] = fwd
        return lambda buf: _advance(buf, fwd(buf), mode)

    def graph(self, key):
        """The graph, buffers and sub-step of a (batch, width, mode, top) shape, captured on first use."""
        hit = self.graphs.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        B, W, mode, top = key
        buf = _Buffers(B, W, self.device, top)
        buf.tables.fill_(self.scratch)
        fn = self._fn(B, mode)
        if self.compile:  # one Inductor graph for every width (and batch >= 2) of a kind
            torch._dynamo.maybe_mark_dynamic(buf.tables, 1)
            if B > 1:
                for t in (buf.ids, buf.pos, buf.tables):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        hit, err = (None, buf, fn), None
        if self.capture:
            # the compiled sub-step captured; failing that the uncompiled one (a graph still saves
            # the launches); failing both it runs eagerly, uncompiled. The first failure is reported.
            forms = [fn] + ([self._fn(B, mode, compiled=False)] if self.compile else [])
            for f in forms:
                try:
                    hit = (cuda_graph(lambda: f(buf), self.pool, self.device, reset=buf.i.zero_), buf, f)
                    break
                except Exception as e:  # noqa: BLE001 - compile or capture
                    buf.i.zero_()
                    err = err or f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            else:
                hit = (None, buf, self._fn(B, mode, compiled=False))
        elif self.compile:  # compiled on the CPU: tried now, on the scratch block, as a capture is
            try:
                fn(buf)
            except Exception as e:  # noqa: BLE001 - compile
                err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                hit = (None, buf, self._fn(B, mode, compiled=False))
            buf.i.zero_()
        if err is not None:
            how = "run eagerly" if hit[0] is None else "captured uncompiled"
            self.failures[key] = (err if hit[0] is None else f"{how}: {err}")[:300]
            warnings.warn(f"decode steps of {B} rows ({mode}) {how}: compiling or capturing "
                          f"them failed ({err[:300]})")
        self.graphs[key] = hit
        self.capture_s += time.perf_counter() - t0
        return hit

    def launch(self, rows: list[tuple], n_steps: int, mode: str, top: int = -1) -> Group | None:
        """Start n_steps sub-steps of rows = (block_table, position, token, temperature, top_k,
        top_p, seed), without waiting for them; None when no shape takes them (more rows than
        the largest bucket). Each table must cover position + n_steps tokens. top >= 0 asks for
        logprobs: per row and step (logprob, [(id, logprob)] of the top `top` tokens)."""
        if not 1 <= n_steps <= MAX_STEPS:
            raise ValueError(f"n_steps must be in 1..{MAX_STEPS}, got {n_steps}")
        lens = [r[1] + n_steps for r in rows]
        tables, width = used_blocks([r[0] for r in rows], lens, self.cache.block_size)
        shape = self.bucket(len(rows), width)
        if shape is None:
            return None
        g, buf, fn = self.graph((*shape, mode, top))
        self._fill(buf, rows, tables)
        grp = Group(g, buf, fn, len(rows), n_steps, lens)
        self._replay(grp)
        self.launches += 1
        return grp

    def relaunch(self, grp: Group, tables: list[list[int] | None], n_steps: int) -> Group | None:
        """The next n_steps sub-steps of the same rows, launched from where `grp` left them on the
        device (their last tokens, positions and sampling state): rows with a table go on, each
        table covering the row's position after `grp` plus n_steps; rows with None (and the
        padding rows) become padding rows (token 0 at position 0 on the scratch block), so no
        row's position outgrows the shape. Call after collect(grp), whose outputs this
        overwrites, or with `early` before it. None when a table no longer fits the shape's width."""
        if not 1 <= n_steps <= MAX_STEPS:
            raise ValueError(f"n_steps must be in 1..{MAX_STEPS}, got {n_steps}")
        buf, bs = grp.buf, self.cache.block_size
        B, W = buf.tables.shape
        go = [i for i, t in enumerate(tables) if t is not None]
        ends = {i: grp.ends[i] + n_steps for i in go}
        if any(-(-e // bs) > W or e > self.max_len for e in ends.values()):
            return None
        buf.tables.copy_(self._tables(B, W, {i: tables[i][:-(-ends[i] // bs)] for i in go}),
                         non_blocking=True)
        off = torch.tensor([i for i in range(B) if i not in ends], dtype=torch.int64)
        if len(off):
            off = off.to(buf.pos.device, non_blocking=True)
            buf.pos.index_fill_(0, off, 0)
            buf.ids.index_fill_(0, off, 0)
        buf.i.zero_()
        nxt = Group(grp.graph, buf, grp.fn, grp.n_rows, n_steps,
                    [ends.get(i, 0) for i in range(grp.n_rows)])
        self._replay(nxt)
        self.relaunches += 1
        return nxt

    def _replay(self, grp: Group) -> None:
        for _ in range(grp.n):
            if grp.graph is None:
                grp.fn(grp.buf)
            else:
                grp.graph.replay()
        self.replays += grp.n if grp.graph is not None else 0
        if self.early:
            grp.host, grp.done = self._copy_out(grp.buf)

    def _copy_out(self, buf: _Buffers):
        """The buffers' outputs copied, in stream order, to the host slot after the last one
        used (pinned on CUDA, so the copy does not wait for the host), and its event."""
        cuda = self.device.type == "cuda"
        s, buf.slot = buf.slot, buf.slot ^ 1
        src = buf.outputs()
        if buf.host[s] is None:
            buf.host[s] = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for k, t in src.items()}
        dst = buf.host[s]
        for k, t in src.items():
            dst[k].copy_(t, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        return dst, done

    def collect(self, grp: Group):
        """(n new tokens per row, their logprobs or None) of a launched group: waits for it."""
        n, k = grp.n_rows, grp.n
        if grp.host is not None:
            if grp.done is not None:
                grp.done.synchronize()
            got = grp.host
        else:
            got = grp.buf.outputs()
        toks = got["out"][:n, :k].tolist()
        if "lp" not in got:
            return toks, None
        lp = got["lp"][:n, :k].tolist()
        if "top_ids" not in got:
            return toks, [logprob_pairs(row) for row in lp]
        ids, vals = got["top_ids"][:n, :k].tolist(), got["top_lp"][:n, :k].tolist()
        return toks, [logprob_pairs(*r) for r in zip(lp, ids, vals)]

    def _tables(self, B: int, W: int, tables: dict[int, list[int]]) -> torch.Tensor:
        """(B, W) int32 host block tables: row i = tables[i], the rest the scratch block; one
        host array (a tensor per row costs ~5 us)."""
        t = np.full((B, W), self.scratch, dtype=np.int32)
        for i, table in tables.items():
            t[i, :len(table)] = table
        return torch.from_numpy(t)

    def _fill(self, buf: _Buffers, rows, tables) -> None:
        """Rows 0 .. n - 1 from the step, the rest padding rows on the scratch block."""
        n, (B, W) = len(rows), buf.tables.shape
        pad = B - n
        ints = torch.tensor([[r[2] for r in rows] + [0] * pad, [r[1] for r in rows] + [0] * pad,
                             [r[4] for r in rows] + [0] * pad, [r[6] for r in rows] + [0] * pad],
                            dtype=torch.int64)
        floats = torch.tensor([[float(r[3]) for r in rows] + [0.0] * pad,
                               [float(r[5]) for r in rows] + [1.0] * pad], dtype=torch.float32)
        buf.tables.copy_(self._tables(B, W, dict(enumerate(tables))), non_blocking=True)
        for dst, src in zip((buf.ids, buf.pos, buf.top_k, buf.seeds), ints):
            dst.copy_(src, non_blocking=True)
        buf.temp.copy_(floats[0], non_blocking=True)
        buf.top_p.copy_(floats[1], non_blocking=True)
        buf.i.zero_()
