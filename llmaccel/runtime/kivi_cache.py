"""Paged KV cache in the packed KIVI format of the `kvquant` pass, and its attention context.

Two pools per layer, both in blocks of G tokens (G = the spec's key group):
- full precision, the layout of PagedKVCache: fk, fv (num_fp, G, Hkv, D);
- packed, the format of llmaccel.ops.kvquant per block: codes kp, vp (num_packed, Hkv, G,
  D*bits/8) uint8; key scale/min ks, km (num_packed, Hkv, D) (one key group per block); value
  scale/min vs, vm (num_packed, Hkv, G, D/value_group).
Which pool a logical block is in, and when tokens move from one to the other, is the block
manager's business (kivi_blocks.py); each step's forward quantizes the groups that age, writes
the new tokens that stay in full precision, and attends with the reference executor's
boundary between dequantized and full-precision keys. The attention here is the PyTorch
reference (any device); single-token rows go through llmaccel::kivi_paged_decode on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import llmaccel.kernels.kivi  # noqa: F401  (registers torch.ops.llmaccel.kivi_quantize_*)
import llmaccel.kernels.paged_kivi  # noqa: F401  (registers torch.ops.llmaccel.paged_kivi_decode)
from llmaccel.errors import LlmaccelError
from llmaccel.ir import attention_layers
from llmaccel.ops.attention import attend_heads
from llmaccel.ops.context import StepContext
from llmaccel.ops.kvquant import (dequantize_keys, dequantize_values, quantize_keys,
                                  quantize_values)
from llmaccel.runtime.kivi_blocks import query_boundary


def kivi_spec(gm) -> dict | None:
    """The one KIVI spec of a graph compiled with kvquant (None without); every attention layer
    must carry the same bits, group and residual, as the kvquant pass writes them."""
    from llmaccel.compiler.executor import kv_quant_specs

    specs = kv_quant_specs(gm)
    if not specs:
        return None
    n_attn = len(attention_layers(gm))
    keys = {(s["bits"], s["group"], s["residual"]) for s in specs.values()}
    if len(keys) != 1 or len(specs) != n_attn:
        raise LlmaccelError("the paged KIVI cache needs every attention layer quantized with the "
                            f"same bits, group and residual; this graph has {sorted(keys)} on "
                            f"{len(specs)} of {n_attn} layers")
    return dict(next(iter(specs.values())))


class KiviPagedCache:
    def __init__(self, layers: dict[int, tuple[int, int]], spec: dict, num_fp: int,
                 num_packed: int, dtype: torch.dtype, device):
        self.spec, self.dtype = spec, dtype
        self.bits, self.group, self.residual = spec["bits"], spec["group"], spec["residual"]
        self.block_size = g = self.group
        self.num_fp, self.num_packed = num_fp, num_packed
        self.layers = dict(layers)
        self.vg = {i: min(g, d) for i, (h, d) in layers.items()}  # make_spec's value group
        z = dict(dtype=dtype, device=device)
        u8 = dict(dtype=torch.uint8, device=device)
        self.fk = {i: torch.zeros(num_fp, g, h, d, **z) for i, (h, d) in layers.items()}
        self.fv = {i: torch.zeros_like(t) for i, t in self.fk.items()}
        self.kp = {i: torch.zeros(num_packed, h, g, d * self.bits // 8, **u8) for i, (h, d) in layers.items()}
        self.vp = {i: torch.zeros_like(t) for i, t in self.kp.items()}
        self.ks = {i: torch.zeros(num_packed, h, d, **z) for i, (h, d) in layers.items()}
        self.km = {i: torch.zeros_like(t) for i, t in self.ks.items()}
        self.vs = {i: torch.zeros(num_packed, h, g, d // self.vg[i], **z) for i, (h, d) in layers.items()}
        self.vm = {i: torch.zeros_like(t) for i, t in self.vs.items()}

    def kv_quant_spec(self, layer: int) -> dict | None:
        return {"bits": self.bits, "group": self.group, "residual": self.residual,
                "value_group": self.vg[layer]}

    @staticmethod
    def fp_bytes_per_token(layers, dtype) -> int:
        return sum(2 * h * d for h, d in layers.values()) * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def packed_bytes_per_token(layers, spec: dict, dtype) -> float:
        """Codes plus scales and mins, per token over all layers (key metadata amortised over G)."""
        es, g, b = torch.empty((), dtype=dtype).element_size(), spec["group"], spec["bits"]
        total = 0.0
        for h, d in layers.values():
            vg = min(g, d)
            total += h * (2 * d * b / 8 + 2 * d * es / g + 2 * (d // vg) * es)
        return total

    def nbytes(self) -> int:
        ts = [*self.fk.values(), *self.fv.values(), *self.kp.values(), *self.vp.values(),
              *self.ks.values(), *self.km.values(), *self.vs.values(), *self.vm.values()]
        return sum(t.nbytes for t in ts)

    def copy_blocks(self, pairs) -> None:
        if pairs:
            raise RuntimeError("KIVI blocks are never shared, so never copied")


def pool_sizes(layers, spec: dict, dtype, *, max_num_seqs: int, tokens: int | None = None,
               budget_bytes: int | None = None) -> tuple[int, int]:
    """(fp blocks, packed blocks). A running sequence holds at most R/G + 1 fp blocks; the fp
    pool gets that for every sequence up to a quarter of the cache, the packed pool the rest.
    `tokens`: the cache's token capacity (kv_cache_tokens); else a byte budget."""
    g = spec["group"]
    per_seq = spec["residual"] // g + 1
    if tokens is not None:
        n = tokens // g
        nf = min(max_num_seqs * per_seq, max(per_seq, n // 4))
        nq = n - nf
    else:
        fpb = KiviPagedCache.fp_bytes_per_token(layers, dtype) * g
        qb = KiviPagedCache.packed_bytes_per_token(layers, spec, dtype) * g
        nf = min(max_num_seqs * per_seq, max(per_seq, budget_bytes // 4 // fpb))
        nq = int((budget_bytes - nf * fpb) // qb)
    if nq < 1:
        raise LlmaccelError(f"the KIVI cache needs room for {per_seq} full-precision blocks of {g} "
                            f"tokens (residual {spec['residual']} + one group) and at least one "
                            f"packed block: give kv_cache_tokens >= {(per_seq + 1) * g}")
    return nf, nq


@dataclass
class SeqStep:
    """One sequence's part of a step: rows [row, row + end - start) of the flattened batch."""
    row: int
    start: int
    end: int
    n_prompt: int
    q0: int            # packed blocks before the step
    nq: int            # packed blocks after it (blocks q0..nq-1 are quantized by this step)
    packed: list[int]  # packed block ids of logical blocks 0..nq-1
    fp: list[int]      # fp block ids of logical blocks q0..; -1: no fp copy (tokens in this chunk)


class KiviContext(StepContext):
    """The attention context of one step over a KiviPagedCache (see PagedContext).

    The first n_decode rows are single-token sequences: batched through `_decode` (write, age,
    then llmaccel::paged_kivi_decode); the others, one sequence at a time through `attend_seq`.
    """

    def __init__(self, cache: KiviPagedCache, seqs: list[SeqStep], n_decode: int, logits_indices,
                 decode: dict | None = None):
        self.cache, self.seqs, self.n_decode = cache, seqs, n_decode
        self.logits_indices = logits_indices
        self.dec = decode  # slots, age_src, age_dst, block_tables, n_packed, lens (tensors)

    def kv_quant_spec(self, layer: int) -> dict | None:
        return self.cache.kv_quant_spec(layer)

    def attend(self, layer, q, k, v, *, n_heads, n_kv_heads, head_dim, scale, **_):
        N = q.shape[1]
        c = self.cache
        q3 = q.reshape(N, n_heads, head_dim)
        k3 = k.reshape(N, n_kv_heads, head_dim).to(c.dtype)
        v3 = v.reshape(N, n_kv_heads, head_dim).to(c.dtype)
        out = torch.empty_like(q3)
        nd = self.n_decode
        if nd:
            out[:nd] = self._decode(layer, q3[:nd], k3[:nd], v3[:nd], scale)
        for st in self.seqs[nd:]:
            rows = slice(st.row, st.row + st.end - st.start)
            out[rows] = attend_seq(c, layer, st, q3[rows], k3[rows], v3[rows], scale)
        return out.reshape(1, N, n_heads * head_dim)

    def _decode(self, layer, q, k, v, scale):
        c, d, g = self.cache, self.dec, self.cache.group
        h, D = k.shape[1:]
        fk, fv = c.fk[layer], c.fv[layer]
        fk.view(-1, h, D)[d["slots"]] = k
        fv.view(-1, h, D)[d["slots"]] = v
        src, dst = d["age_src"], d["age_dst"]
        M = src.numel()
        if M:  # whole groups leaving the residual window, quantized from their fp blocks
            vg = c.vg[layer]
            kp, ksc, kmn = torch.ops.llmaccel.kivi_quantize_keys(
                fk[src].transpose(1, 2).reshape(M * h, g, D), c.bits, g)
            vp, vsc, vmn = torch.ops.llmaccel.kivi_quantize_values(
                fv[src].transpose(1, 2).reshape(M * h, g, D), c.bits, vg)
            c.kp[layer][dst], c.vp[layer][dst] = kp.view(M, h, g, -1), vp.view(M, h, g, -1)
            c.ks[layer][dst], c.km[layer][dst] = ksc.view(M, h, D), kmn.view(M, h, D)
            c.vs[layer][dst], c.vm[layer][dst] = vsc.view(M, h, g, -1), vmn.view(M, h, g, -1)
        return torch.ops.llmaccel.paged_kivi_decode(
            q, c.kp[layer], c.ks[layer], c.km[layer], c.vp[layer], c.vs[layer], c.vm[layer], fk, fv,
            d["block_tables"], d["n_packed"], d["lens"], scale=scale, bits=c.bits, group=g,
            value_group=c.vg[layer])


def _gather_fp(pool: torch.Tensor, ids: list[int], n: int) -> torch.Tensor:
    if n == 0:
        return pool.new_zeros(0, *pool.shape[2:])
    sel = torch.tensor(ids[: -(-n // pool.shape[1])], device=pool.device)
    return pool[sel].flatten(0, 1)[:n]


def _packed_prefix(c: KiviPagedCache, layer: int, st: SeqStep, dev):
    """The sequence's packed groups 0 .. q0 - 1, dequantized: keys, values (q0 * group, Hkv, D)."""
    g, bits, vg = c.group, c.bits, c.vg[layer]
    ids = torch.tensor(st.packed[: st.q0], device=dev)
    kpk = dequantize_keys(c.kp[layer][ids], c.ks[layer][ids][:, :, None], c.km[layer][ids][:, :, None],
                          bits, g).transpose(1, 2).flatten(0, 1)
    vpk = dequantize_values(c.vp[layer][ids], c.vs[layer][ids], c.vm[layer][ids], bits,
                            vg).transpose(1, 2).flatten(0, 1)
    return kpk, vpk


def attend_seq(c: KiviPagedCache, layer: int, st: SeqStep, q, k, v, scale: float) -> torch.Tensor:
    """Reference for one sequence: q, k, v (T, H|Hkv, D) at positions [start, end). Quantizes the
    groups that age, writes the tokens that stay in full precision, and attends every query with
    the reference executor's boundary (query_boundary) between dequantized and exact keys."""
    g, bits, vg, R = c.group, c.bits, c.vg[layer], c.residual
    dev = q.device
    qs, qt = st.q0 * g, st.nq * g
    # Tokens [qs, end) in full precision: older ones from the fp pool, then this chunk.
    n_old = st.start - qs
    ks_ = torch.cat([_gather_fp(c.fk[layer], st.fp, n_old), k])
    vs_ = torch.cat([_gather_fp(c.fv[layer], st.fp, n_old), v])
    # Groups of that range that some query of the chunk sees quantized; the first nq - q0 of
    # them are stored packed now.
    bq = min(query_boundary(st.end - 1, st.n_prompt, g, R), g * (st.end // g))
    ng = max(0, (bq - qs) // g)
    kfq = vfq = ks_[:0]
    if ng:
        kg = ks_[: ng * g].unflatten(0, (ng, g)).transpose(1, 2)  # (ng, Hkv, G, D)
        vgr = vs_[: ng * g].unflatten(0, (ng, g)).transpose(1, 2)
        kp, ksc, kmn = quantize_keys(kg, bits, g)
        vp, vsc, vmn = quantize_values(vgr, bits, vg)
        nw = st.nq - st.q0
        if nw:
            ids = torch.tensor(st.packed[st.q0: st.nq], device=dev)
            c.kp[layer][ids], c.ks[layer][ids], c.km[layer][ids] = kp[:nw], ksc[:nw, :, 0], kmn[:nw, :, 0]
            c.vp[layer][ids], c.vs[layer][ids], c.vm[layer][ids] = vp[:nw], vsc[:nw], vmn[:nw]
        kfq = dequantize_keys(kp, ksc, kmn, bits, g).transpose(1, 2).flatten(0, 1)
        vfq = dequantize_values(vp, vsc, vmn, bits, vg).transpose(1, 2).flatten(0, 1)
    # New tokens that stay in full precision go to their fp blocks.
    w0 = max(qt, st.start)
    if w0 < st.end:
        slots = torch.tensor([st.fp[p // g - st.q0] * g + p % g for p in range(w0, st.end)], device=dev)
        c.fk[layer].view(-1, *k.shape[1:])[slots] = k[w0 - st.start:]
        c.fv[layer].view(-1, *v.shape[1:])[slots] = v[w0 - st.start:]
    kpk, vpk = _packed_prefix(c, layer, st, dev) if st.q0 else (ks_[:0], vs_[:0])
    # Queries in runs of equal boundary (prompt rows share one; each generated row its own).
    out, p = [], st.start
    while p < st.end:
        b = query_boundary(p, st.n_prompt, g, R)
        p2 = p + 1
        while p2 < st.end and query_boundary(p2, st.n_prompt, g, R) == b:
            p2 += 1
        nb = min(b, bq) - qs
        kk = torch.cat([kpk, kfq[:max(0, nb)], ks_[max(0, nb):]])
        vv = torch.cat([vpk, vfq[:max(0, nb)], vs_[max(0, nb):]])
        qpos = torch.arange(p, p2, device=dev)[:, None]
        mask = torch.arange(st.end, device=dev)[None, :] <= qpos
        o = attend_heads(q[p - st.start: p2 - st.start].transpose(0, 1)[None],
                         kk.to(q.dtype).transpose(0, 1)[None], vv.to(q.dtype).transpose(0, 1)[None],
                         scale=scale, mask=mask)
        out.append(o[0].transpose(0, 1))
        p = p2
    return out[0] if len(out) == 1 else torch.cat(out)


def build_kivi_step(cache: KiviPagedCache, items: list, want_logits: list[int], device):
    """Inputs for one forward over `items` = (sequence, new token ids), single tokens first.
    The sequences' tables are already laid out for the step (KiviBlockManager.grow)."""
    ids, pos, rows, seqs, n_decode, g = [], [], [], [], 0, cache.group
    for (seq, toks), nl in zip(items, want_logits):
        start, T = seq.num_computed, len(toks)
        if T == 1 and len(seqs) == n_decode:
            n_decode += 1
        base = len(ids)
        ids.extend(toks)
        pos.extend(range(start, start + T))
        rows.extend(range(base + T - nl, base + T))
        end = start + T
        fp = [seq.kivi_fp_old.get(i, -1) for i in range(seq.kivi_q0, seq.kivi_nq)]
        fp += seq.block_table[seq.kivi_nq: -(-end // g)]
        seqs.append(SeqStep(base, start, end, seq.n_prompt, seq.kivi_q0, seq.kivi_nq,
                            seq.block_table[: seq.kivi_nq], fp))

    def dev(x, dt=torch.int64):
        return torch.tensor(x, dtype=dt).to(device, non_blocking=True)

    dec = None
    if n_decode:
        d = seqs[:n_decode]
        for st in d:  # a single-token row attends with the boundary it stores (decode semantics)
            if query_boundary(st.start, st.n_prompt, g, cache.residual) != st.nq * g:
                raise RuntimeError("a single-token KIVI row must end on its storage boundary")
        pairs = [(st.fp[i - st.q0], st.packed[i]) for st in d for i in range(st.q0, st.nq)]
        width = max(-(-st.end // g) for st in d)
        bt = torch.zeros(n_decode, width, dtype=torch.int32)
        for i, (seq, _) in enumerate(items[:n_decode]):
            n = -(-d[i].end // g)
            bt[i, :n] = torch.tensor(seq.block_table[:n], dtype=torch.int32)
        dec = dict(slots=dev([st.fp[st.start // g - st.q0] * g + st.start % g for st in d]),
                   age_src=dev([p[0] for p in pairs]), age_dst=dev([p[1] for p in pairs]),
                   block_tables=bt.to(device, non_blocking=True),
                   n_packed=dev([st.nq for st in d], torch.int32),
                   lens=dev([st.end for st in d], torch.int32))
    ctx = KiviContext(cache, seqs, n_decode, dev(rows), dec)
    return dev([ids]), dev([pos]), ctx


def kivi_metrics(cache: KiviPagedCache, bm) -> dict:
    """Bytes per token of the packed format (quantized tokens) against full precision, and how
    the two pools are sized and used. Prefix caching is off for KIVI caches."""
    packed = KiviPagedCache.packed_bytes_per_token(cache.layers, cache.spec, cache.dtype)
    fp = KiviPagedCache.fp_bytes_per_token(cache.layers, cache.dtype)
    g = cache.group
    tokens = (cache.num_fp + cache.num_packed) * g
    return dict(kv_quant=f"kivi bits={cache.bits} group={g} residual={cache.residual}",
                kv_bytes_per_token=round(packed, 1), kv_bytes_per_token_fp=fp,
                kv_bytes_per_token_bf16=KiviPagedCache.fp_bytes_per_token(cache.layers, torch.bfloat16),
                kv_cache_bytes=cache.nbytes(), kv_cache_tokens=tokens,
                kv_cache_bytes_per_token=round(cache.nbytes() / tokens, 1),
                kv_fp_blocks_total=cache.num_fp, kv_packed_blocks_total=cache.num_packed,
                kv_fp_blocks_used=bm.fp_used, kv_packed_blocks_used=bm.packed_used)
