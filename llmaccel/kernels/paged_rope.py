"""Paged decode attention with RoPE and the KV write inside: one launch per layer (plus the
split merge) for a decode step of the runtime.

  llmaccel::paged_rope_decode_attention(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin,
                                        *, scale) -> (B, H, D)
      q (B, H, D), k, v (B, Hkv, D) before their rotary embedding, or k = v = None with q the
      fused projection's rows (B, H + 2 Hkv, D) read in place; pos (B,) int64 the position of
      each row's new token; block_tables (B, W) int32; cos / sin (max_len, D) fp32 tables.
      Rotates q and k at pos (rotate-half layout, as ops.rope), writes k, v at slot
      table[pos // bs] * bs + pos % bs of the paged cache (blocks, bs, Hkv, D), and returns
      softmax(q K[0..pos]^T * scale) V[0..pos] per row. k_scale, v_scale (trailing, optional):
      the row scales of an int8 cache (kernels/paged_attention.py), which then holds codes.

Without it a decode layer spends the rotation's pointwise kernels, two index_copy_ writes and
the attention (docs/runtime.md); at one row on small models, launches are the cost. The Triton
kernel reads the cache through the block table: cached slots 0 .. pos - 1 split into parts (each
a share of the row's own context, in whole tiles) run in parallel and merged by log-sum-exp, the new token's k, v taken from registers by the split that owns slot pos (which
also stores them; no program reads that slot, so there is no race). The split count depends on
the table width only, so a captured CUDA graph stays valid as positions advance within it.
CPU implementation: the reference; CUDA: Triton. CPU decode steps call plain functions instead
(no custom-op dispatch): paged_rope_decode_cpu eagerly, paged_rope_decode_masked compiled.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmaccel.kernels import pdl_enabled, registered, sm_count, unit_stride
from llmaccel.kernels.paged_attention import (cached_rows, decode_splits, paged_decode_ref, scale_args,
                                              write_kv_ref)

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton
    triton = None


def split_fused(q, k, v, n_kv: int):
    """(q, k, v); with k = v = None, views of q's rows (B, H + 2 Hkv, D)."""
    if k is not None:
        return q, k, v
    return q.split([q.shape[1] - 2 * n_kv, n_kv, n_kv], dim=1)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, heads, D), row b at position pos[b]: the tables rounded to x's
    dtype as ops.rope does, products and sum in fp32, rounded once."""
    c = cos[pos].to(x.dtype).float()[:, None, :]
    s = sin[pos].to(x.dtype).float()[:, None, :]
    h = x.float()
    x1, x2 = h.chunk(2, dim=-1)
    return (h * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)


def slots_of(pos: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    blk = block_tables.gather(1, (pos // block_size)[:, None].long())[:, 0].long()
    return blk * block_size + pos % block_size


def paged_rope_decode_ref(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin, scale: float,
                          k_scale=None, v_scale=None):
    q, k, v = split_fused(q, k, v, k_cache.shape[2])
    q, k = rope_rows(q, cos, sin, pos), rope_rows(k, cos, sin, pos)
    write_kv_ref(k, v, k_cache, v_cache, slots_of(pos, block_tables, k_cache.shape[1]), k_scale, v_scale)
    return paged_decode_ref(q, k_cache, v_cache, block_tables, (pos + 1).to(torch.int32), scale,
                            k_scale, v_scale)


def paged_rope_decode_masked(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin, scale: float,
                             k_scale=None, v_scale=None):
    """The op's values without a host read: every row attends over its whole table (B, W), the
    slots past pos masked. What a compiled CPU decode step traces (the width is the shape's, at
    most twice the longest context). The products and sums are written out, not SDPA, so that
    Inductor fuses the gather (and an int8 cache's dequantization) into the two reductions and
    reads each cached key and value once, where SDPA reads a gathered copy (SmolLM2-135M at
    3,072 tokens, 2 cores: a step 34.2-34.5 against 35.2-36.4 ms, and no first-run spikes)."""
    q, k, v = split_fused(q, k, v, k_cache.shape[2])
    nq = q.shape[1]
    qk = rope_rows(torch.cat((q, k), 1), cos, sin, pos)
    q, k = qk[:, :nq], qk[:, nq:]
    B, W = block_tables.shape
    BS, Hkv, D = k_cache.shape[1:]
    write_kv_ref(k, v, k_cache, v_cache, slots_of(pos, block_tables, BS), k_scale, v_scale)
    bt = block_tables.long()
    kb = cached_rows(k_cache, k_scale, bt, torch.float32).reshape(B, W * BS, Hkv, 1, D)   # (B, L, Hkv, 1, D)
    vb = cached_rows(v_cache, v_scale, bt, torch.float32).reshape(B, W * BS, Hkv, 1, D)
    H = q.shape[1]
    s = (q.float().view(B, 1, Hkv, H // Hkv, D) * kb).sum(-1) * scale                       # (B, L, Hkv, G)
    mask = torch.arange(W * BS, device=q.device)[None, :] <= pos[:, None]
    p = torch.softmax(s.masked_fill(~mask[:, :, None, None], float("-inf")), dim=1)
    return (p[..., None] * vb).sum(1).reshape(B, H, D).to(q.dtype)


# Rows up to which the CPU form attends row by row over each row's own context (a batch pads
# every row to the longest context instead; the reference then does it).
CPU_ROWS = 8


def paged_rope_decode_cpu(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin, scale: float,
                          k_scale=None, v_scale=None):
    """The op's values on a CPU for eager decode steps, in a few aten calls a row: the custom
    op's dispatch and the reference's padded, masked batch cost ~0.5 ms a layer at one row of
    SmolLM2-135M on 2 cores, several times the attention itself. Up to CPU_ROWS rows, else the
    reference. Reads pos on the host (a CPU tensor: no device sync)."""
    B = q.shape[0]
    if B > CPU_ROWS:
        return paged_rope_decode_ref(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin, scale,
                                     k_scale, v_scale)
    q, k, v = split_fused(q, k, v, k_cache.shape[2])
    # q and k rotated together: one lookup of the tables' rows
    nq = q.shape[1]
    qk = rope_rows(torch.cat((q, k), 1), cos, sin, pos)
    q, k = qk[:, :nq], qk[:, nq:]
    BS, Hkv, D = k_cache.shape[1:]
    write_kv_ref(k, v, k_cache, v_cache, slots_of(pos, block_tables, BS), k_scale, v_scale)
    H = q.shape[1]
    out = q.new_empty(q.shape)
    for b, length in enumerate((pos + 1).tolist()):
        n = -(-length // BS)
        ids = block_tables[b, :n].tolist()
        if ids == list(range(ids[0], ids[0] + n)):  # blocks in order (a lone request's): a view
            blk = slice(ids[0], ids[0] + n)
        else:
            blk = block_tables[b, :n].long()
        kb = cached_rows(k_cache, k_scale, blk, q.dtype).reshape(-1, Hkv, D)[:length].transpose(0, 1)  # (Hkv, L, D)
        vb = cached_rows(v_cache, v_scale, blk, q.dtype).reshape(-1, Hkv, D)[:length].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].view(Hkv, H // Hkv, D), kb, vb, scale=scale)
        out[b] = o.reshape(H, D)
    return out


if triton is not None:
    from triton.language.extra import cuda as _tl_cuda

    from llmaccel.kernels.paged_attention import (_group_queries, _row_scales, _softmax_block,
                                                  _softmax_init, _softmax_result, merge_splits)

    @triton.jit
    def _stored(x, XC, XS, slot, row, d_ok, dt, QUANT: tl.constexpr):
        """x (D,) written at XC + slot, as codes with its row scale at XS + row where QUANT (the
        int8 cache: kv_int8.quantize_rows); returned as a reader gets it back (dt, in fp32)."""
        if QUANT:
            xf = x.to(tl.float32)
            sc = (tl.max(tl.where(d_ok, tl.abs(xf), 0.0), 0) * (1.0 / 127)).to(tl.float16)
            s32 = sc.to(tl.float32)
            inv = tl.where(s32 > 0, 1.0 / tl.where(s32 > 0, s32, 1.0), 0.0)
            code = tl.minimum(tl.maximum(tl.floor(xf * inv + 0.5), -127.0), 127.0)
            tl.store(XC + slot, code.to(tl.int8), mask=d_ok)
            tl.store(XS + row, sc)
            back = (code * s32).to(dt).to(tl.float32)
        else:
            tl.store(XC + slot, x.to(XC.dtype.element_ty), mask=d_ok)
            back = x.to(XC.dtype.element_ty).to(dt).to(tl.float32)
        return back

    @triton.jit
    def _new_token(KR, VR, KC, VC, KS, VS, BTR, P, kvh, sc_blk, sc_s, sc_h, offs_d, d_ok, c, s, q,
                   m_i, l_i, acc, scale, D: tl.constexpr, BS: tl.constexpr, QUANT: tl.constexpr):
        """The row's new key (rotated) and value (at KR, VR) stored at slot P of its table
        (BTR), and attended: the softmax state with them."""
        kn = tl.load(KR + offs_d, mask=d_ok, other=0.0)
        vn = tl.load(VR + offs_d, mask=d_ok, other=0.0)
        kn = _rotate(kn, KR, 0, 0, offs_d, d_ok, c, s, D)
        blk = tl.load(BTR + P // BS).to(tl.int64)
        base = blk * sc_blk + (P % BS) * sc_s + kvh * sc_h
        # the new key and value in the cache's precision, as the reference reads them back
        kn = _stored(kn, KC, KS, base + offs_d, base // D, d_ok, q.dtype, QUANT)
        vn = _stored(vn, VC, VS, base + offs_d, base // D, d_ok, q.dtype, QUANT)
        qk = tl.sum(q.to(tl.float32) * kn[None, :], 1) * scale
        m_new = tl.maximum(m_i, qk)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * vn[None, :]
        return m_new, l_i, acc

    @triton.jit
    def _rotate(x, X, rows, s_row, offs_d, ok, c, s, D: tl.constexpr):
        """x (rows at X + rows * s_row) with its rotary embedding: x * c + rotate_half(x) * s in
        fp32 (c, s the table rows at pos, rounded to x's dtype), rounded to x's dtype once."""
        HALF: tl.constexpr = D // 2
        low = offs_d < HALF
        partner = tl.where(low, offs_d + HALF, offs_d - HALF)
        xp = tl.load(X + rows * s_row + partner, mask=ok, other=0.0).to(tl.float32)
        rot = tl.where(low, -xp, xp)
        return (x.to(tl.float32) * c + rot * s).to(x.dtype)

    @triton.jit
    def _rope_row(COS, SIN, P, s_cos, offs_d, d_ok, dt):
        """The rope tables' row at position P, rounded to dt as ops.rope does, in fp32."""
        c = tl.load(COS + P * s_cos + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
        s = tl.load(SIN + P * s_cos + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
        return c, s

    @triton.jit
    def _kv_tile(KC, VC, KS, VS, BT, n0, stop, kvh, sc_blk, sc_s, sc_h, offs_d, d_ok, dt,
                 BS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, QUANT: tl.constexpr):
        """Cached keys and values n0 .. n0 + BLOCK_N (those below stop) of one KV head, through
        the row's block table BT; with their mask and (QUANT) their row scales."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        blk = tl.load(BT + offs_n // BS, mask=n_ok, other=0).to(tl.int64)
        base = blk * sc_blk + (offs_n % BS) * sc_s + kvh * sc_h
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(KC + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(dt)
        v = tl.load(VC + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(dt)
        ks, vs = _row_scales(KS, VS, base // D, n_ok, QUANT)
        return k, v, n_ok, ks, vs

    @triton.jit
    def _paged_rope_decode_kernel(Q, K, V, KC, VC, KS, VS, POS, BT, O, MID_O, MID_LSE, COS, SIN, scale,
                                  sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sc_blk, sc_s, sc_h,
                                  sbt, s_cos, so_b, so_h, smo_s, smo_h, smo_p, sml_s, sml_h,
                                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BS: tl.constexpr,
                                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                                  SPLIT: tl.constexpr, IEEE: tl.constexpr, PEEL: tl.constexpr,
                                  PDL: tl.constexpr, QUANT: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        P = tl.load(POS + b).to(tl.int32)
        # The splits share this row's keys 0 .. P in whole tiles: their count is fixed by the
        # shape (a captured graph keeps it) while the context they divide grows.
        split_len = tl.cdiv(tl.cdiv(P + 1, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        start = sp * split_len
        stop = tl.minimum(start + split_len, P)  # cached keys of this split: [start, stop)
        dt = Q.dtype.element_ty
        first = start  # the first key the loop below reads
        if PEEL:  # (always with PDL)
            # Before the wait for the kernel before: what does not depend on it. Positions,
            # tables, rope tables and the cached keys and values were all written before the
            # step's first kernel; only q and the new k, v come from the projection just before.
            # (Without PDL the plain loop: peeling the first tile cost a third more time at 64
            # rows.)
            offs_d = tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            c, s = _rope_row(COS, SIN, P, s_cos, offs_d, d_ok, dt)
            k0, v0, n_ok0, ks0, vs0 = _kv_tile(KC, VC, KS, VS, BT + b * sbt, start, stop, kvh, sc_blk, sc_s,
                                               sc_h, offs_d, d_ok, dt, BS, BLOCK_N, D, QUANT)  # first tile
        if PDL:
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()
        q, heads, offs_d, g_ok, d_ok = _group_queries(Q + b * sq_b, kvh, sq_h, GROUP, BLOCK_G, D, BLOCK_D)
        if not PEEL:
            c, s = _rope_row(COS, SIN, P, s_cos, offs_d, d_ok, dt)
        q = _rotate(q, Q + b * sq_b, heads[:, None], sq_h, offs_d[None, :],
                    g_ok[:, None] & d_ok[None, :], c[None, :], s[None, :], D)
        m_i, l_i, acc = _softmax_init(BLOCK_G, BLOCK_D)
        if PEEL:
            if start < stop:
                m_i, l_i, acc = _softmax_block(q, k0, v0, n_ok0, m_i, l_i, acc, scale, ks0, vs0, IEEE,
                                               QUANT)
            first = start + BLOCK_N
        for n0 in range(first, stop, BLOCK_N):
            k, v, n_ok, ks, vs = _kv_tile(KC, VC, KS, VS, BT + b * sbt, n0, stop, kvh, sc_blk, sc_s,
                                          sc_h, offs_d, d_ok, dt, BS, BLOCK_N, D, QUANT)
            m_i, l_i, acc = _softmax_block(q, k, v, n_ok, m_i, l_i, acc, scale, ks, vs, IEEE, QUANT)
        if (P >= start) & (P < start + split_len):  # this split owns slot pos
            m_i, l_i, acc = _new_token(K + b * sk_b + kvh * sk_h, V + b * sv_b + kvh * sv_h, KC, VC,
                                       KS, VS, BT + b * sbt, P, kvh, sc_blk, sc_s, sc_h, offs_d, d_ok,
                                       c, s, q, m_i, l_i, acc, scale, D, BS, QUANT)
        acc, lse = _softmax_result(acc, l_i, m_i)
        om = g_ok[:, None] & d_ok[None, :]
        if SPLIT:
            tl.store(MID_O + b * smo_s + heads[:, None] * smo_h + sp * smo_p + offs_d[None, :], acc,
                     mask=om)
            tl.store(MID_LSE + b * sml_s + heads * sml_h + sp, lse, mask=g_ok)
        else:
            tl.store(O + b * so_b + heads[:, None] * so_h + offs_d[None, :],
                     acc.to(O.dtype.element_ty), mask=om)


def _check(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin):
    B, H, D = q.shape
    nb, BS, Hkv, Dc = k_cache.shape
    if v_cache.shape != k_cache.shape or Dc != D or H % Hkv or k.shape != (B, Hkv, D) or v.shape != k.shape:
        raise ValueError(f"paged rope decode: q {tuple(q.shape)}, k {tuple(k.shape)}, cache "
                         f"{tuple(k_cache.shape)} disagree")
    if pos.shape != (B,) or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"paged rope decode: pos {tuple(pos.shape)} and tables "
                         f"{tuple(block_tables.shape)} must have one row per query row ({B})")
    if cos.shape != sin.shape or cos.shape[-1] != D or D % 2 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"paged rope decode: rope tables {tuple(cos.shape)} do not fit head_dim {D}")


def decode_block_n(B: int, block_d: int) -> int:
    """Keys a tile. 128 at head_dim 64: 15% less time than 64 on the H200 over 1-256 rows of
    128-1,536 tokens (B=256: 151 -> 137 us, 3.5 TB/s; docs/results/h200-2026-12-02-attn.json).
    At head_dim 128, 64 at one row (llama2-7b: 6.4 us against 7.3 with 32, three splits;
    docs/results/h200-2026-11-30-attn-probe-7b.json), 32 at more rows."""
    return 128 if block_d <= 64 else (64 if B == 1 else 32)


def paged_rope_decode_triton(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin, scale: float,
                             num_splits: int | None = None, block_n: int | None = None,
                             num_warps: int = 4, num_stages: int = 3,
                             pdl: bool | None = None, peel: bool | None = None,
                             k_scale=None, v_scale=None) -> torch.Tensor:
    """pdl: launched early behind the kernel before (programmatic dependent launch), reading what
    does not depend on it before waiting, and letting the kernel after launch early too (the
    next projection's GEMV then reads its weights while this one runs). None: at one row where
    the device has it (H200, llama-1b: a decode step 0.889 -> 0.854 ms); not at more rows,
    where cuBLAS GEMMs surround it and its early programs slowed the step (64 rows: 1.37 ->
    1.50 ms). peel: read the first tile of keys before the wait (default: with pdl; apart from
    it only to test that path where PDL is not available)."""
    q, k, v = split_fused(q, k, v, k_cache.shape[2])
    _check(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin)
    B, H, D = q.shape
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)  # fused-qkv views read in place
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N = block_n or decode_block_n(B, BLOCK_D)
    # splits as short as one tile: the kernel sizes them to each row's context
    n = num_splits or decode_splits(B, Hkv, block_tables.shape[1] * BS, BLOCK_N, sm_count(q.device),
                                    min_len=BLOCK_N)
    if n > 1:
        mid_o = torch.empty((B, H, n, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, H, n), dtype=torch.float32, device=q.device)
    else:
        mid_o, mid_lse = out, out  # unused (SPLIT=False); any tensors with the strides read
    G = H // Hkv
    if pdl is None:
        pdl = B == 1 and pdl_enabled(q)
    ks, vs, quant = scale_args(k_cache, k_scale, v_scale)
    _paged_rope_decode_kernel[(B, Hkv, n)](
        q, k, v, k_cache, v_cache, ks, vs, pos, block_tables, out, mid_o, mid_lse, cos, sin, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), cos.stride(0),
        out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=G, BLOCK_G=max(16, triton.next_power_of_2(G)), BS=BS, D=D, BLOCK_D=BLOCK_D,
        BLOCK_N=BLOCK_N, SPLIT=n > 1, IEEE=q.dtype == torch.float32,
        PEEL=pdl if peel is None else peel, PDL=pdl, QUANT=quant, num_warps=num_warps,
        num_stages=num_stages, **({"launch_pdl": True} if pdl else {}))
    if n > 1:
        merge_splits(mid_o, mid_lse, out, pdl)
    return out


if not registered("paged_rope_decode_attention"):
    @torch.library.custom_op("llmaccel::paged_rope_decode_attention",
                             mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
    def paged_rope_decode_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                                    k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                                    block_tables: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                    k_scale: torch.Tensor | None,
                                    v_scale: torch.Tensor | None, *, scale: float) -> torch.Tensor:
        """Rotate q, k at pos, write k, v at pos's slot, attend q over slots 0 .. pos per row;
        k = v = None: q is (B, H + 2 Hkv, D). On CUDA at one row it launches early behind the
        kernel before (PDL) and reads pos, block_tables, cos, sin and the cache before waiting
        for it: only q, k, v may come from that kernel (in the decode step, the projection)."""
        return paged_rope_decode_ref(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin, scale,
                                     k_scale, v_scale)

    @paged_rope_decode_attention.register_fake
    def _(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin, k_scale=None, v_scale=None, *, scale):
        B, H, D = split_fused(q, k, v, k_cache.shape[2])[0].shape
        return q.new_empty((B, H, D))

    if triton is not None:
        @paged_rope_decode_attention.register_kernel("cuda")
        def _(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin, k_scale=None, v_scale=None, *,
              scale):
            return paged_rope_decode_triton(q, k, v, k_cache, v_cache, pos, block_tables, cos, sin, scale,
                                            k_scale=k_scale, v_scale=v_scale)
