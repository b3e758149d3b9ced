"""Paged attention: attention over a block-table KV cache, with the KV write folded in.

Cache layout (per layer): k_cache, v_cache of shape (num_blocks, block_size, n_kv_heads, head_dim);
token slot `s` lives at block s // block_size, offset s % block_size. A flattened batch of S
sequences carries per-token q (N, H, D) and new k, v (N, Hkv, D), `slot_mapping` (N,) where the
new k, v go, `block_tables` (S, max_blocks) int32, and per sequence `context_lens` (S,) = tokens
in the cache after the write. Queries of a sequence are its last q_len positions (chunked prefill,
speculative verification) and attend causally.

An int8 cache (kvquant.bits=8, ops/kv_int8.py) holds int8 codes there and beside them fp16
scales of shape (num_blocks, block_size, n_kv_heads), one per stored row; the ops take the scale
tensors (None for a cache in the model's dtype), quantize what they write and read codes * scale.

Two custom ops, both writing k, v into the cache first:
  llmaccel::paged_decode_attention   one query per sequence; Triton split-K (FlashDecoding):
                                     the context is cut into splits run in parallel, then merged
                                     by log-sum-exp; all query heads of a KV group share K loads.
  llmaccel::paged_prefill_attention  q_len >= 1 per sequence (cu_seqlens_q), causal over the
                                     cached prefix and the new tokens.
CPU implementations are the references; CUDA implementations are the Triton wrappers.
"""
from __future__ import annotations

import torch

from llmaccel.kernels import cdiv, sm_count
from llmaccel.ops.attention import attend_heads
from llmaccel.ops.kv_int8 import dequantize_rows, quantize_rows

try:  # kernels are optional: every non-CUDA path must work without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """k, v (N, Hkv, D) into slots slot_mapping; as int8 codes with their row scales where the
    scale tensors are given."""
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    idx = slot_mapping.long()
    for x, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if sc is None:
            cache.view(-1, Hkv, D).index_copy_(0, idx, x.to(cache.dtype))
        else:
            codes, s = quantize_rows(x)
            cache.view(-1, Hkv, D).index_copy_(0, idx, codes)
            sc.view(-1, Hkv).index_copy_(0, idx, s)


def cached_rows(cache, scale, index, dtype) -> torch.Tensor:
    """cache[index] in `dtype`: dequantized where `scale` (the int8 cache's row scales) is given."""
    rows = cache[index]
    return rows.to(dtype) if scale is None else dequantize_rows(rows, scale[index], dtype)


def paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                        scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """Reference: each sequence's queries attend causally over its first context_len slots.

    Sequences with the same number of queries (e.g. speculative verification) run as one batch
    over keys padded to the longest context and masked.
    """
    N, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    groups: dict[int, list[int]] = {}
    for s in range(len(lens)):
        if cu[s + 1] > cu[s]:
            groups.setdefault(cu[s + 1] - cu[s], []).append(s)
    for T, ss in groups.items():
        L = max(lens[s] for s in ss)
        nb = cdiv(L, bs)
        bt = block_tables[ss, :nb].long()
        k = cached_rows(k_cache, k_scale, bt, q.dtype).reshape(len(ss), nb * bs, Hkv, D)[:, :L].transpose(1, 2)
        v = cached_rows(v_cache, v_scale, bt, q.dtype).reshape(len(ss), nb * bs, Hkv, D)[:, :L].transpose(1, 2)
        rows = torch.tensor([list(range(cu[s], cu[s] + T)) for s in ss], device=q.device)
        last = torch.tensor([lens[s] for s in ss], device=q.device)[:, None] - T
        qpos = last + torch.arange(T, device=q.device)[None, :]  # (n, T) absolute positions
        mask = torch.arange(L, device=q.device)[None, None, :] <= qpos[:, :, None]
        o = attend_heads(q[rows].transpose(1, 2), k, v, scale=scale, mask=mask[:, None])
        out[rows] = o.transpose(1, 2)
    return out


def paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                     k_scale=None, v_scale=None) -> torch.Tensor:
    """Reference for one query per sequence: all sequences at once over padded, masked keys."""
    S, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    nb = cdiv(max_len, bs)
    bt = block_tables[:, :nb].long()
    k = cached_rows(k_cache, k_scale, bt, q.dtype).reshape(S, nb * bs, Hkv, D)[:, :max_len].transpose(1, 2)
    v = cached_rows(v_cache, v_scale, bt, q.dtype).reshape(S, nb * bs, Hkv, D)[:, :max_len].transpose(1, 2)
    mask = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    o = attend_heads(q[:, :, None, :], k, v, scale=scale, mask=mask[:, None, None, :])
    return o[:, :, 0, :]


# --------------------------------------------------------------------------- Triton kernels
if triton is not None:
    from triton.language.extra import cuda as _tl_cuda

    # Values that vary from one eager step to the next are not specialized on: the table width
    # (sbt) with the step's longest context, the split length, the split count and the strides
    # of the splits' buffers with its batch; nor the alignment of the prefill rows' tables and
    # lengths, views that start after the decode rows. A new divisibility or alignment would
    # compile a variant in the middle of a running load (seconds, every request waiting).
    @triton.jit(do_not_specialize=["sbt"], do_not_specialize_on_alignment=["BT", "LENS"])
    def _paged_prefill_kernel(Q, KC, VC, KS, VS, O, BT, CU, LENS, scale,
                              sq_n, sq_h, so_n, so_h, sk_b, sk_s, sk_h, sbt,
                              GROUP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              IEEE: tl.constexpr, QUANT: tl.constexpr):
        s = tl.program_id(0)
        h = tl.program_id(1)
        mt = tl.program_id(2)
        q0 = tl.load(CU + s)
        T = tl.load(CU + s + 1) - q0
        L = tl.load(LENS + s)
        if mt * BLOCK_M < T:
            kvh = h // GROUP
            offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            m_ok = offs_m < T
            d_ok = offs_d < D
            q = tl.load(Q + (q0 + offs_m)[:, None].to(tl.int64) * sq_n + h * sq_h + offs_d[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            qpos = L - T + offs_m
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            end = tl.minimum(L, L - T + (mt + 1) * BLOCK_M)  # keys the last row of the tile sees
            for n0 in range(0, end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_ok = offs_n < end
                blk = tl.load(BT + s * sbt + offs_n // BS, mask=n_ok, other=0).to(tl.int64)
                base = blk * sk_b + (offs_n % BS) * sk_s + kvh * sk_h
                kv_mask = n_ok[:, None] & d_ok[None, :]
                k = tl.load(KC + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
                if IEEE:
                    qk = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    qk = tl.dot(q, tl.trans(k))
                qk = qk * scale
                if QUANT:  # codes * row scale: the scale of each key multiplies its column
                    qk = qk * tl.load(KS + base // D, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                visible = (offs_n[None, :] <= qpos[:, None]) & n_ok[None, :]
                qk = tl.where(visible, qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(VC + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
                if QUANT:  # values dequantized in fp32 (a scaled p would underflow fp16 sooner)
                    vsc = tl.load(VS + base // D, mask=n_ok, other=0.0).to(tl.float32)
                    v = v.to(tl.float32) * vsc[:, None]
                v = v.to(q.dtype)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(O + (q0 + offs_m)[:, None].to(tl.int64) * so_n + h * so_h + offs_d[None, :],
                     acc.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _softmax_init(BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """Running max, sum and output of an online softmax before any key."""
        return (tl.full([BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_G], tl.float32),
                tl.zeros([BLOCK_G, BLOCK_D], tl.float32))

    @triton.jit
    def _softmax_block(q, k, v, n_ok, m_i, l_i, acc, scale, ks, vs, IEEE: tl.constexpr,
                       QUANT: tl.constexpr):
        """One block of keys k and values v (N, D), n_ok of them real, for query rows q (G, D)
        in an online softmax: returns the running max, sum and (unnormalized) output. QUANT: k
        and v are int8 codes (in q's dtype, exact) with row scales ks, vs (N,) fp32: a key's scale
        multiplies its logit, a value's its row."""
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if QUANT:
            qk = qk * ks[None, :]
            # values dequantized in fp32, then in q's dtype (a scaled p would underflow fp16 sooner)
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
        qk = tl.where(n_ok[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _row_scales(KS, VS, rows, ok, QUANT: tl.constexpr):
        """The int8 cache's key and value scales of slots `rows` (fp32); with QUANT off, nothing
        is read (KS, VS may point anywhere) and the zeros returned are never used."""
        ks = tl.zeros(rows.shape, tl.float32)
        vs = tl.zeros(rows.shape, tl.float32)
        if QUANT:
            ks = tl.load(KS + rows, mask=ok, other=0.0).to(tl.float32)
            vs = tl.load(VS + rows, mask=ok, other=0.0).to(tl.float32)
        return ks, vs

    @triton.jit
    def _group_queries(Q, kvh, sq_h, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        """The query rows of KV head kvh's group as one (BLOCK_G, BLOCK_D) tile (Q points at the
        sequence's row), so K and V are read once per group; with their head ids and masks."""
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < GROUP
        d_ok = offs_d < D
        heads = kvh * GROUP + offs_g
        q = tl.load(Q + heads[:, None] * sq_h + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0)
        return q, heads, offs_d, g_ok, d_ok

    @triton.jit
    def _softmax_result(acc, l_i, m_i):
        """The normalized output of an online softmax and its log-sum-exp (-inf for rows that
        saw no key), what a split hands to the reduce."""
        has = l_i > 0
        acc = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        return acc, lse

    @triton.jit(do_not_specialize=["split_len", "sbt", "smo_s", "smo_h", "sml_s", "sml_h"])
    def _paged_decode_kernel(Q, KC, VC, KS, VS, MID_O, MID_LSE, BT, LENS, scale, split_len,
                             sq_n, sq_h, sk_b, sk_s, sk_h, sbt, smo_s, smo_h, smo_p, sml_s, sml_h,
                             GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BS: tl.constexpr,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                             IEEE: tl.constexpr, QUANT: tl.constexpr):
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        L = tl.load(LENS + s)
        start = sp * split_len
        stop = tl.minimum(start + split_len, L)
        q, heads, offs_d, g_ok, d_ok = _group_queries(Q + s * sq_n, kvh, sq_h, GROUP, BLOCK_G, D, BLOCK_D)
        m_i, l_i, acc = _softmax_init(BLOCK_G, BLOCK_D)
        for n0 in range(start, stop, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < stop
            blk = tl.load(BT + s * sbt + offs_n // BS, mask=n_ok, other=0).to(tl.int64)
            base = blk * sk_b + (offs_n % BS) * sk_s + kvh * sk_h
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(KC + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(VC + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            ks, vs = _row_scales(KS, VS, base // D, n_ok, QUANT)
            m_i, l_i, acc = _softmax_block(q, k, v, n_ok, m_i, l_i, acc, scale, ks, vs, IEEE, QUANT)
        acc, lse = _softmax_result(acc, l_i, m_i)
        tl.store(MID_O + s * smo_s + heads[:, None] * smo_h + sp * smo_p + offs_d[None, :], acc,
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(MID_LSE + s * sml_s + heads * sml_h + sp, lse, mask=g_ok)

    @triton.jit(do_not_specialize=["n_splits", "smo_s", "smo_h", "sml_s", "sml_h"])
    def _paged_decode_reduce_kernel(MID_O, MID_LSE, O, n_splits, smo_s, smo_h, smo_p, sml_s, sml_h,
                                    so_n, so_h, D: tl.constexpr, BLOCK_D: tl.constexpr,
                                    BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # launched early behind the split kernel (static decode attention): wait for it
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()
        s = tl.program_id(0)
        h = tl.program_id(1)
        offs_p = tl.arange(0, BLOCK_P)
        offs_d = tl.arange(0, BLOCK_D)
        p_ok = offs_p < n_splits
        lse = tl.load(MID_LSE + s * sml_s + h * sml_h + offs_p, mask=p_ok, other=float("-inf"))
        m = tl.max(lse, 0)  # split 0 always holds the first token, so m is finite
        w = tl.where(p_ok, tl.exp(lse - m), 0.0)
        o = tl.load(MID_O + s * smo_s + h * smo_h + offs_p[:, None] * smo_p + offs_d[None, :],
                    mask=p_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(O + s * so_n + h * so_h + offs_d, out.to(O.dtype.element_ty), mask=offs_d < D)


def _check(q, k_cache, v_cache, block_tables, context_lens):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged attention: q {tuple(q.shape)} must be (N, H, D) and caches "
                         f"(blocks, block_size, Hkv, D); got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"paged attention: {q.shape[1]} query heads of dim {q.shape[2]} do not "
                         f"fit {k_cache.shape[2]} KV heads of dim {k_cache.shape[3]}")
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError("paged attention: block_tables and context_lens disagree on the batch")


def scale_args(k_cache, k_scale, v_scale) -> tuple:
    """(KS, VS, QUANT) for a kernel: an int8 cache's row scales (the kernels find a slot's
    scale at its code offset // head_dim: both contiguous), or the cache itself, unread."""
    if (k_scale is None) != (v_scale is None) or (k_scale is None) != (k_cache.dtype != torch.int8):
        raise ValueError(f"paged attention: a {k_cache.dtype} cache with {'no' if k_scale is None else 'a'} key "
                         f"scale and {'no' if v_scale is None else 'a'} value scale; an int8 cache takes both, "
                         f"another neither")
    if k_scale is None:
        return k_cache, k_cache, False
    if not (k_cache.is_contiguous() and k_scale.is_contiguous() and v_scale.is_contiguous()
            and k_scale.shape == k_cache.shape[:3] == v_scale.shape):
        raise ValueError(f"paged attention: int8 cache {tuple(k_cache.shape)} and its scales "
                         f"{tuple(k_scale.shape)} must be contiguous, one scale per slot and KV head")
    return k_scale, v_scale, True


def paged_prefill_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float,
                         max_q_len: int, k_scale=None, v_scale=None) -> torch.Tensor:
    """Triton varlen causal attention over the paged cache (the KV write happens before)."""
    _check(q, k_cache, v_cache, block_tables, context_lens)
    N, H, D = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    S = context_lens.shape[0]
    if N == 0 or S == 0:
        return out
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_M = 16 if max_q_len <= 16 else (32 if BLOCK_D > 64 else 64)
    BLOCK_N = 32 if BLOCK_D > 64 else 64
    grid = (S, H, cdiv(max_q_len, BLOCK_M))
    ks, vs, quant = scale_args(k_cache, k_scale, v_scale)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, ks, vs, out, block_tables, cu_seqlens_q, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=H // k_cache.shape[2], BS=k_cache.shape[1], D=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32, QUANT=quant)
    return out


def decode_splits(S: int, Hkv: int, max_len: int, block_n: int, num_sms: int,
                  min_len: int = 256) -> int:
    """How many splits of the context: enough programs to fill the GPU, none shorter than
    min_len tokens (nor one tile) of the widest context max_len."""
    want = cdiv(2 * num_sms, max(1, S * Hkv))
    return max(1, min(want, cdiv(max_len, max(min_len, block_n))))


def split_plan(q: torch.Tensor, n_kv: int, max_len: int, block_n: int,
               num_splits: int | None = None) -> tuple[int, int]:
    """(splits, tokens per split) of a decode over contexts up to max_len: decode_splits on the
    device's SM count (kernels.INTERPRETER_SMS under the interpreter), each split a whole number of
    block_n tiles."""
    n = num_splits or decode_splits(q.shape[0], n_kv, max_len, block_n,
                                    sm_count(q.device))
    split_len = cdiv(cdiv(max_len, n), block_n) * block_n
    return cdiv(max_len, split_len), split_len


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor,
                 pdl: bool = False) -> None:
    """out (S, H, D) from the splits' outputs mid_o (S, H, n, D) and log-sum-exps (S, H, n);
    pdl: launched early behind the split kernel (which must let it)."""
    S, H, n, D = mid_o.shape
    _paged_decode_reduce_kernel[(S, H)](
        mid_o, mid_lse, out, n, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_P=max(2, triton.next_power_of_2(n)),
        PDL=pdl, **({"launch_pdl": True} if pdl else {}))


def paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                        num_splits: int | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    """Triton split-K decode attention: one query per sequence over its paged context.

    The split count depends only on shapes (the block-table width bounds the context), never on
    values, so a captured CUDA graph stays valid as lengths grow within the table.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    S, H, D = q.shape
    Hkv, BS = k_cache.shape[2], k_cache.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    if S == 0:
        return out
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N = 64 if BLOCK_D <= 64 else 32
    n, split_len = split_plan(q, Hkv, block_tables.shape[1] * BS, BLOCK_N, num_splits)
    mid_o = torch.empty((S, H, n, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((S, H, n), dtype=torch.float32, device=q.device)
    G = H // Hkv
    ks, vs, quant = scale_args(k_cache, k_scale, v_scale)
    _paged_decode_kernel[(S, Hkv, n)](
        q, k_cache, v_cache, ks, vs, mid_o, mid_lse, block_tables, context_lens, scale, split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=G, BLOCK_G=max(16, triton.next_power_of_2(G)), BS=BS, D=D, BLOCK_D=BLOCK_D,
        BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32, QUANT=quant)
    merge_splits(mid_o, mid_lse, out)
    return out


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("llmaccel::paged_decode_attention",
                         mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, *,
                           scale: float) -> torch.Tensor:
    """Write k, v (S, Hkv, D) at slot_mapping, then attend q (S, H, D) over each context;
    k_scale, v_scale: the row scales of an int8 cache."""
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)


@torch.library.custom_op("llmaccel::paged_prefill_attention",
                         mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def paged_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, k_scale: torch.Tensor | None,
                            v_scale: torch.Tensor | None, *, scale: float,
                            max_q_len: int) -> torch.Tensor:
    """Write k, v (N, Hkv, D) at slot_mapping, then causal attention of q (N, H, D) per sequence."""
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                               k_scale, v_scale)


@paged_decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens, k_scale=None, v_scale=None,
      *, scale):
    return torch.empty_like(q)


@paged_prefill_attention.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, cu_seqlens_q, context_lens, k_scale=None,
      v_scale=None, *, scale, max_q_len):
    return torch.empty_like(q)


if triton is not None:
    @paged_decode_attention.register_kernel("cuda")
    def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens, k_scale=None,
          v_scale=None, *, scale):
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale,
                                   k_scale=k_scale, v_scale=v_scale)

    @paged_prefill_attention.register_kernel("cuda")
    def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, cu_seqlens_q, context_lens,
          k_scale=None, v_scale=None, *, scale, max_q_len):
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return paged_prefill_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                    scale, max_q_len, k_scale, v_scale)
