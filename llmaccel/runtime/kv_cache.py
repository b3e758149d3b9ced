"""Paged KV cache tensors and the attention context that a step's graph forward runs with.

The cache is allocated once: on the GPU from a memory fraction, on the CPU from a token count.
`PagedContext` implements the IR's attention protocol (`ctx.attend(layer, q, k, v, ...)`) for a
flattened batch: input_ids (1, N) hold the new tokens of every sequence of the step back to back,
sequences with one new token (decode) first, then those with more (prefill chunks, speculative
verification). Each attention node writes its k, v into the cache and attends over the block
table through the llmaccel::paged_* custom ops (reference on CPU, Triton on CUDA).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.fx

import llmaccel.kernels.paged_attention  # noqa: F401  (registers torch.ops.llmaccel.paged_*)
from llmaccel.errors import LlmaccelError
from llmaccel.ops.context import StepContext
from llmaccel.ops.kv_int8 import SCALE_DTYPE, row_bytes


class PagedKVCache:
    """Per layer k, v blocks (num_blocks, block_size, Hkv, D) in the model's dtype; for the
    layers in `int8` codes, with their row scales (num_blocks, block_size, Hkv) in k_scale,
    v_scale (ops/kv_int8.py)."""

    def __init__(self, layers: dict[int, tuple[int, int]], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device, int8: frozenset[int] = frozenset()):
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.device = torch.empty(0, device=device).device   # with its index, as the tensors'
        self.k = {i: torch.zeros(num_blocks, block_size, h, d, dtype=torch.int8 if i in int8 else dtype,
                                 device=device) for i, (h, d) in layers.items()}
        self.v = {i: torch.zeros_like(t) for i, t in self.k.items()}
        self.k_scale = {i: torch.zeros(num_blocks, block_size, layers[i][0], dtype=SCALE_DTYPE, device=device)
                        for i in layers if i in int8}
        self.v_scale = {i: torch.zeros_like(t) for i, t in self.k_scale.items()}

    @staticmethod
    def bytes_per_token(layers: dict[int, tuple[int, int]], dtype: torch.dtype,
                        int8: frozenset[int] = frozenset()) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(row_bytes(h, d) if i in int8 else 2 * h * d * size for i, (h, d) in layers.items())

    def layer(self, i: int, coded: bool) -> tuple:
        """(k, v, k_scale, v_scale) of layer i for the paged ops (scales None unless int8);
        `coded`: whether the graph's node says the layer is int8, which the cache must match."""
        if coded != (i in self.k_scale):
            raise LlmaccelError(f"attention layer {i} {'is' if coded else 'is not'} int8-quantized but "
                                f"this cache {'is not' if coded else 'is'}: build it from the same graph")
        return self.k[i], self.v[i], self.k_scale.get(i), self.v_scale.get(i)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=src.device)
        for t in [*self.k.values(), *self.v.values(), *self.k_scale.values(), *self.v_scale.values()]:
            t[dst] = t[src]


class PagedContext(StepContext):
    """Per-step metadata plus the cache; built by `build_step` and passed as the graph's ctx."""

    def __init__(self, cache: PagedKVCache, n_decode: int, slot_mapping, block_tables, context_lens,
                 cu_seqlens_q, max_q_len: int, logits_indices):
        self.cache = cache
        self.n_decode = n_decode  # the first n_decode tokens are single-token sequences
        self.slot_mapping, self.block_tables, self.context_lens = slot_mapping, block_tables, context_lens
        self.cu_prefill = cu_seqlens_q  # for the sequences after the decode ones, offsets from 0
        self.max_q_len = max_q_len
        self.logits_indices = logits_indices

    def attend(self, layer, q, k, v, *, n_heads, n_kv_heads, head_dim, scale, kv_dtype=None, **_):
        N = q.shape[1]
        q3 = q.reshape(N, n_heads, head_dim)
        k3 = k.reshape(N, n_kv_heads, head_dim)
        v3 = v.reshape(N, n_kv_heads, head_dim)
        kc, vc, ks, vs = self.cache.layer(layer, kv_dtype is not None)
        nd, outs = self.n_decode, []
        if nd:
            outs.append(torch.ops.llmaccel.paged_decode_attention(
                q3[:nd], k3[:nd], v3[:nd], kc, vc, self.slot_mapping[:nd], self.block_tables[:nd],
                self.context_lens[:nd], ks, vs, scale=scale))
        if nd < N:
            outs.append(torch.ops.llmaccel.paged_prefill_attention(
                q3[nd:], k3[nd:], v3[nd:], kc, vc, self.slot_mapping[nd:], self.block_tables[nd:],
                self.cu_prefill, self.context_lens[nd:], ks, vs, scale=scale, max_q_len=self.max_q_len))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(1, N, n_heads * head_dim)


def slot(table: list[int], p: int, block_size: int) -> int:
    """The cache slot of position p of a sequence with block table `table`."""
    return table[p // block_size] * block_size + p % block_size


def chunk_slots(table: list[int], start: int, T: int, block_size: int) -> np.ndarray:
    """The cache slots of positions start .. start + T - 1 (int64): whole blocks at a time (a
    prefill step of 8,192 tokens spent milliseconds of host time in a call per token)."""
    b0 = start // block_size
    blocks = np.asarray(table[b0: (start + T - 1) // block_size + 1], dtype=np.int64)
    off = start - b0 * block_size
    return (blocks[:, None] * block_size + np.arange(block_size)).ravel()[off: off + T]


def used_blocks(tables: list[list[int]], lens: list[int], block_size: int) -> tuple[list[list[int]], int]:
    """Each table cut to the blocks its first lens[i] tokens use, and the widest of them."""
    used = [table[:-(-L // block_size)] for table, L in zip(tables, lens)]
    return used, max(map(len, used))


def table_tensor(tables: list[list[int]], width: int) -> torch.Tensor:
    """Block tables as one int32 host tensor (rows, width), each row padded with block 0."""
    return torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def build_step(cache: PagedKVCache, items: list[tuple[list[int], int, list[int]]], want_logits: list[int],
               device) -> tuple[torch.Tensor, torch.Tensor, PagedContext]:
    """Inputs for one forward over `items` = (block_table, start position, new token ids).

    Items with one token must come first. want_logits[i] is how many trailing rows of item i
    need logits (0: none, a prefill chunk that does not reach the end of its sequence).
    Returns input_ids (1, N), positions (1, N) and the context.
    """
    bs = cache.block_size
    ids, pos, slots, lens, qlens, rows = [], [], [], [], [], []
    n_decode, seen_multi = 0, False
    for (table, start, toks), nl in zip(items, want_logits):
        T = len(toks)
        if T == 1 and not seen_multi:
            n_decode += 1
        else:
            seen_multi = True
        base = len(ids)
        ids.extend(toks)
        pos.extend(range(start, start + T))
        slots.append([slot(table, start, bs)] if T == 1 else chunk_slots(table, start, T, bs))
        lens.append(start + T)
        qlens.append(T)
        rows.extend(range(base + T - nl, base + T))
    bt = table_tensor(*used_blocks([table for table, _, _ in items], lens, bs))
    cu = [0]
    for t in qlens[n_decode:]:
        cu.append(cu[-1] + t)

    def dev(x, dt=torch.int32):
        return torch.tensor(x, dtype=dt).to(device, non_blocking=True)

    slots = torch.from_numpy(np.concatenate(slots).astype(np.int64, copy=False)) if slots else \
        torch.zeros(0, dtype=torch.int64)
    ctx = PagedContext(cache, n_decode, slots.to(device, non_blocking=True), bt.to(device, non_blocking=True),
                       dev(lens), dev(cu), max(qlens[n_decode:], default=0), dev(rows, torch.int64))
    return dev([ids], torch.int64), dev([pos], torch.int64), ctx
