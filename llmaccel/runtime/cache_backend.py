"""The engine's cache kinds behind one protocol, chosen once when an engine starts.

A graph's attention decides what its cache holds: KV blocks in the model's dtype (`PagedBackend`),
KIVI-packed KV blocks (`KiviBackend`: a kvquant graph) or one recurrent state per sequence
(`SlaBackend`: linear attention). Each backend owns its cache and the block manager that hands
out its blocks, and answers what the scheduler, the model runner and the decode steps ask of a
cache: how to build an eager step's inputs and what to do after its forward, each decode row's
table for the runner, what a launched or lost decode group leaves, and its metrics. What a kind
cannot do (decode on the runner, hold an eager step's tokens, speculate) is a class attribute,
so the engine asks once instead of branching on the kind.
"""
from __future__ import annotations

import gc
import warnings

import torch

from llmaccel.errors import LlmaccelError
from llmaccel.ops.kv_int8 import int8_layers
from llmaccel.ops.sla import state_bytes
from llmaccel.runtime.block_manager import BlockManager
from llmaccel.runtime.kivi_blocks import KiviBlockManager
from llmaccel.runtime.kivi_cache import (KiviPagedCache, build_kivi_step, kivi_metrics, kivi_spec,
                                         pool_sizes as kivi_pool_sizes)
from llmaccel.runtime.kv_cache import PagedKVCache, build_step
from llmaccel.runtime.sequence import Sequence
from llmaccel.runtime.sla_states import SlaDecodeContext, SlaStates, build_sla_step, sla_specs

CPU_CACHE_BYTES = 512 << 20


def budget_tokens(device, cfg, bytes_per_token: int, max_batched: int, fraction: float,
                  fixed: int | None = None) -> int:
    """Tokens of `bytes_per_token` that the memory budget holds: `fixed` bytes where given; on
    CUDA, `fraction` of the card less what is allocated and a headroom for activations; on the
    CPU, CPU_CACHE_BYTES."""
    if fixed is not None:
        if fixed < bytes_per_token:
            raise LlmaccelError(f"kv_cache_bytes={fixed} holds no token of {bytes_per_token} bytes")
        return fixed // bytes_per_token
    if not str(device).startswith("cuda"):
        return max(1, CPU_CACHE_BYTES // bytes_per_token)
    # an engine its caller dropped holds its cache until the cycle collector runs (its runners
    # and graphs refer to each other): without this, a second LLM in a process would count the
    # first one's cache against its own budget
    gc.collect()
    total = torch.cuda.get_device_properties(device).total_memory
    headroom = (2 << 30) + max_batched * cfg.intermediate_size * 16
    # allocated, not reserved: memory a previous engine freed is still reserved by the caching
    # allocator but is reusable by this cache
    budget = int(total * fraction) - torch.cuda.memory_allocated(device) - headroom
    if budget < bytes_per_token:
        raise LlmaccelError(f"no GPU memory left for the KV cache ({budget / 2**30:.1f} GiB "
                            f"budget); lower max_num_batched_tokens or raise the fraction")
    return budget // bytes_per_token


class CacheBackend:
    """One cache kind (subclasses). `cache`, `bm` (its block manager), `max_num_seqs` (the
    slots it holds, at most the engine's), `max_blocks` (a decode row's table width)."""
    name = ""
    decodes_on_runner = True   # decode steps on the DecodeRunner (CUDA graphs, sampling inside)
    holds_steps = True         # an eager step's tokens may be read one step later
    step_graphs = True         # a lone prompt's prefill replayed as a CUDA graph
    cache: object
    bm: BlockManager
    max_num_seqs: int
    max_blocks: int

    def step_items(self, plan) -> list:
        """An eager step's items for step_inputs: (table, start, tokens) per planned sequence."""
        return [(seq.block_table, seq.num_computed, toks) for seq, toks, _ in plan]

    def step_inputs(self, items, want: list[int], device):
        """(ids, positions, context) of an eager step."""
        return build_step(self.cache, items, want, device)

    def after_forward(self, ctx, plan) -> None:
        """What the cache records once an eager step's forward has run."""

    def runner_kwargs(self) -> dict:
        """The DecodeRunner's context and scratch row for this cache (default: paged)."""
        return {}

    def runner_tables(self, seqs: list[Sequence], ahead: int) -> list[list[int]]:
        """Each row's table for the decode runner once `ahead` more tokens are computed."""
        return [s.block_table for s in seqs]

    def launched(self, seqs: list[Sequence], tables: list[list[int]], ahead: int, n: int) -> None:
        """n decode sub-steps launched on the rows' runner tables from `ahead` tokens on."""

    def lost(self, seqs: list[Sequence], sched) -> None:
        """After a failure while a decode group ran or was applied (a KV cache's extra entries
        are simply overwritten as the rows go on)."""

    def copy_blocks(self, copies) -> None:
        self.cache.copy_blocks(copies)

    def metrics(self) -> dict:
        return {}


class PagedBackend(CacheBackend):
    """KV blocks in the model's dtype, prefix caching; one block more than the manager hands
    out: the decode runner's padding rows write there."""
    name = "paged"

    def __init__(self, layers, *, tokens: int, block_size: int, dtype, device, max_num_seqs: int,
                 max_position: int, prefix_caching: bool, int8: frozenset[int] = frozenset()):
        num_blocks = tokens // block_size
        if num_blocks < 1:
            raise LlmaccelError(f"kv_cache_tokens={tokens} holds no block of {block_size} tokens")
        self.cache = PagedKVCache(layers, num_blocks + 1, block_size, dtype, device, int8)
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.max_num_seqs, self.max_blocks = max_num_seqs, -(-max_position // block_size)
        self.bytes_per_token = PagedKVCache.bytes_per_token(layers, dtype, int8)
        self.kv_dtype = "int8" if int8 else str(dtype).removeprefix("torch.")

    def metrics(self) -> dict:
        return dict(kv_dtype=self.kv_dtype, kv_bytes_per_token=self.bytes_per_token,
                    kv_cache_tokens=self.bm.num_blocks * self.bm.block_size)


class KiviBackend(CacheBackend):
    """Packed KIVI blocks of one key group beside a full-precision pool for the newest tokens
    (kivi_cache.py); no prefix caching, no speculation; decode steps run eagerly and read
    their tokens at once."""
    name = "kivi"
    decodes_on_runner = holds_steps = step_graphs = False

    def __init__(self, layers, spec: dict, *, tokens: int | None, budget: int | None, dtype, device,
                 max_num_seqs: int, max_batched: int):
        g, r = spec["group"], spec["residual"]
        if max_batched < g:
            raise LlmaccelError(f"max_num_batched_tokens must be at least the KIVI group ({g})")
        nf, nq = kivi_pool_sizes(layers, spec, dtype, max_num_seqs=max_num_seqs, tokens=tokens,
                                 budget_bytes=budget)
        self.spec = spec
        self.cache = KiviPagedCache(layers, spec, nf, nq, dtype, device)
        self.bm = KiviBlockManager(nf, nq, g, r)
        self.max_num_seqs, self.max_blocks = max_num_seqs, 0

    def step_items(self, plan) -> list:
        return [(seq, toks) for seq, toks, _ in plan]

    def step_inputs(self, items, want, device):
        return build_kivi_step(self.cache, items, want, device)

    def after_forward(self, ctx, plan) -> None:
        for seq, _, _ in plan:
            self.bm.release_aged(seq)

    def metrics(self) -> dict:
        return kivi_metrics(self.cache, self.bm)


class SlaBackend(CacheBackend):
    """One slot of recurrent states per sequence (sla_states.py): a block manager of one block
    of the longest sequence per slot, no prefix caching, no speculation (a state cannot roll
    back rejected tokens). With CUDA graphs every slot's state is allocated at once (the graphs
    keep the tensors' addresses), so the slots are as many as the memory budget holds."""
    name = "sla"
    step_graphs = False

    def __init__(self, specs: dict, *, max_num_seqs: int, max_position: int, dtype, device,
                 fixed: bool, budget: int | None):
        if fixed:
            max_num_seqs = self._slots(specs, max_num_seqs, dtype, budget)
        self.cache = SlaStates(specs, slots=max_num_seqs, max_len=max_position, dtype=dtype,
                               device=device, fixed=fixed)
        self.bm = BlockManager(max_num_seqs, max_position, prefix_caching=False)
        self.max_num_seqs, self.max_blocks = max_num_seqs, 1

    @staticmethod
    def _slots(specs: dict, slots: int, dtype, budget: int) -> int:
        """How many sequences' states (two buffers each, and the scratch pair) `budget` bytes
        hold, at most `slots`; fewer with a warning, none with an error."""
        per = 2 * sum(state_bytes(sp["n_kv_heads"], sp["head_dim"], sp["kernel_size"], dtype.itemsize,
                                  sp.get("window", 0), sp.get("sinks", 0)) for sp in specs.values())
        fit = budget // per - 1
        if fit < 1:
            raise LlmaccelError(f"no GPU memory left for one sequence's linear-attention states "
                                f"({per / 2**20:.1f} MiB); lower max_num_batched_tokens or raise the fraction")
        if fit < slots:
            warnings.warn(f"max_num_seqs lowered from {slots} to {fit}: the linear-attention states of "
                          f"{slots} sequences ({per / 2**20:.1f} MiB each) exceed the GPU memory budget")
        return min(slots, fit)

    def step_inputs(self, items, want, device):
        return build_sla_step(self.cache, items, want, device)

    def after_forward(self, ctx, plan) -> None:
        ctx.commit()  # the states after the step are where the forward wrote them

    def runner_kwargs(self) -> dict:
        return dict(context=SlaDecodeContext, scratch=0)

    def runner_tables(self, seqs, ahead):
        return [[self.cache.decode_row(s.block_table[0], s.num_computed + ahead)] for s in seqs]

    def launched(self, seqs, tables, ahead, n):
        for s, t in zip(seqs, tables):
            self.cache.ran(t[0], s.num_computed + ahead, n)

    def lost(self, seqs, sched):
        # the rows still running are computed again from their tokens: their states may be
        # past, or short of, what the host applied
        for s in seqs:
            if not s.finished:
                sched.requeue(s)

    def metrics(self) -> dict:
        # the slots' recurrent states (at most two per slot and layer: before and after a step)
        return dict(sla_state_bytes=self.cache.nbytes())


def check_speculative(gm) -> None:
    """Refuse speculation on a cache kind that cannot roll back rejected tokens (before any
    draft model is loaded)."""
    if sla_specs(gm):
        raise LlmaccelError("speculative decoding does not run on linear attention (sla) yet: its "
                            "recurrent state cannot roll back rejected tokens; drop speculative=")
    if kivi_spec(gm) is not None:
        raise LlmaccelError("speculative decoding does not run on a KIVI-quantized cache yet; "
                            "drop speculative= or compile without kvquant")


def make_backend(gm, cfg, layers, *, dtype, device, block_size: int, kv_cache_tokens: int | None,
                 max_num_seqs: int, max_batched: int, fraction: float, capture: bool,
                 prefix_caching: bool, extra_bytes_per_token: int = 0,
                 kv_cache_bytes: int | None = None) -> CacheBackend:
    """The backend for graph `gm`'s attention. extra_bytes_per_token: a draft model's own KV,
    sized with the target's; kv_cache_bytes: a fixed budget instead of the memory fraction."""
    specs, kivi = sla_specs(gm), kivi_spec(gm)
    fixed = kv_cache_bytes
    if specs:
        budget = budget_tokens(device, cfg, 1, max_batched, fraction, fixed) if capture or fixed else None
        return SlaBackend(specs, max_num_seqs=max_num_seqs, max_position=cfg.max_position,
                          dtype=dtype, device=device, fixed=capture, budget=budget)
    if kivi is not None:
        budget = None if kv_cache_tokens is not None else budget_tokens(device, cfg, 1, max_batched, fraction, fixed)
        return KiviBackend(layers, kivi, tokens=kv_cache_tokens, budget=budget, dtype=dtype, device=device,
                           max_num_seqs=max_num_seqs, max_batched=max_batched)
    int8 = frozenset(int8_layers(gm))
    bpt = PagedKVCache.bytes_per_token(layers, dtype, int8) + extra_bytes_per_token
    tokens = kv_cache_tokens if kv_cache_tokens is not None else budget_tokens(
        device, cfg, bpt, max_batched, fraction, fixed)
    return PagedBackend(layers, tokens=tokens, block_size=block_size, dtype=dtype, device=device,
                        max_num_seqs=max_num_seqs, max_position=cfg.max_position,
                        prefix_caching=prefix_caching, int8=int8)


__all__ = ["CacheBackend", "check_speculative", "PagedBackend", "KiviBackend", "SlaBackend", "make_backend", "budget_tokens",
           "CPU_CACHE_BYTES"]
