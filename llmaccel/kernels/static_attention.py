"""Decode attention over the static KV cache, with the KV write folded in (one launch per layer).

Cache layout (per layer, codegen/static_cache.py): k_cache, v_cache of shape
(batch, n_kv_heads, max_len, head_dim); every row of the static batch decodes at the same
position `pos`, a one-element device tensor (so a captured CUDA graph replays every step).

  llmaccel::static_decode_attention(q (B, H, D), k, v (B, Hkv, D), k_cache, v_cache, pos,
                                    cos=None, sin=None, *, scale)
      writes k, v at slot pos of each row and returns softmax(q K[0..pos]^T * scale) V[0..pos].
      With cos / sin tables (max_len, D), fp32, q and k arrive without their rotary embedding
      and the kernel applies it at row pos (rotate-half layout, as ops.rope): the three
      pointwise launches per layer that rotate q and k and lay them out for the op go away.
      With k = v = None, q holds the fused projection's rows (B, H + 2 Hkv, D): q, k, v are
      read from that one buffer (the GEMV that makes it stores it once, in its epilogue).

The static decode step otherwise spends 5 launches per layer on this (the K and V writes, two
batched matmuls and the masked softmax between them, all over the whole max_len buffer); at
batch 1 on small models, launches are the cost. The Triton kernel reads only slots 0 .. pos - 1
from the cache and takes the new token's k, v from registers (the same program also stores them
to the cache, and no program reads slot pos, so there is no race). All query heads of a KV group
are rows of one tile. Long caches are cut into splits run in parallel and merged by log-sum-exp
(the paged kernel's reduce); the split count depends on the shapes only, never on pos.
CPU implementation: the reference (index_copy_ + masked attention); CUDA: Triton.
"""
from __future__ import annotations

import torch

from llmaccel.kernels import cdiv, pdl_enabled, registered, unit_stride
from llmaccel.ops.attention import attend_heads

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton
    triton = None


def rope_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, heads, D) at position pos, rotate-half layout: the tables are
    rounded to x's dtype as ops.rope does, the products and the sum are taken in fp32 and
    rounded once (as a compiled rope and the kernel compute it)."""
    c = cos[pos.reshape(1)].to(x.dtype).float()
    s = sin[pos.reshape(1)].to(x.dtype).float()
    h = x.float()
    x1, x2 = h.chunk(2, dim=-1)
    return (h * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)


def split_qkv(q, k, v, k_cache):
    """(q, k, v); with k = v = None, views of q's rows (B, H + 2 Hkv, D)."""
    if k is not None:
        return q, k, v
    Hkv = k_cache.shape[1]
    return q.split([q.shape[1] - 2 * Hkv, Hkv, Hkv], dim=1)


def static_decode_ref(q, k, v, k_cache, v_cache, pos, scale: float, cos=None, sin=None) -> torch.Tensor:
    """Reference: (rotate q and k at pos,) write k, v at pos, then attend over slots 0 .. pos
    (in q's dtype, fp32 softmax as attend_heads does)."""
    q, k, v = split_qkv(q, k, v, k_cache)
    if cos is not None:
        q, k = rope_at(q, cos, sin, pos), rope_at(k, cos, sin, pos)
    k_cache.index_copy_(2, pos.reshape(1), k[:, :, None, :].to(k_cache.dtype))
    v_cache.index_copy_(2, pos.reshape(1), v[:, :, None, :].to(v_cache.dtype))
    S = k_cache.shape[2]
    mask = torch.arange(S, device=q.device) <= pos.reshape(1)
    out = attend_heads(q[:, :, None, :], k_cache.to(q.dtype), v_cache.to(q.dtype), scale=scale,
                       mask=mask[None, None, None, :])
    return out[:, :, 0, :]


if triton is not None:
    from triton.language.extra import cuda as _tl_cuda

    from llmaccel.kernels.paged_attention import (_group_queries, _paged_decode_reduce_kernel,
                                                  _softmax_block, _softmax_init, _softmax_result)

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
    def _static_decode_kernel(Q, K, V, KC, VC, POS, O, MID_O, MID_LSE, COS, SIN, scale, split_len,
                              sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sc_b, sc_h, sc_s, s_cos,
                              so_b, so_h, smo_s, smo_h, smo_p,
                              sml_s, sml_h, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                              SPLIT: tl.constexpr, IEEE: tl.constexpr, ROPE: tl.constexpr,
                              PDL: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        P = tl.load(POS).to(tl.int32)  # written by the previous step, before the kernel before
        start = sp * split_len
        stop = tl.minimum(start + split_len, P)  # cached keys of this split: [start, stop)
        cache = b * sc_b + kvh * sc_h
        # The first block of cached keys and values is loaded before waiting for the kernel
        # before (PDL): only q and the new k, v come from it, so these loads overlap its tail.
        offs_n = start + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        n_ok = offs_n < stop
        kv_mask = n_ok[:, None] & (offs_d < D)[None, :]
        ptr = cache + offs_n[:, None].to(tl.int64) * sc_s + offs_d[None, :]
        k_first = tl.load(KC + ptr, mask=kv_mask, other=0.0)
        v_first = tl.load(VC + ptr, mask=kv_mask, other=0.0)
        if PDL:  # launched early behind the GEMV that makes q, k, v: wait for it
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()
        q, heads, offs_d, g_ok, d_ok = _group_queries(Q + b * sq_b, kvh, sq_h, GROUP, BLOCK_G, D, BLOCK_D)
        if ROPE:
            c = tl.load(COS + P * s_cos + offs_d, mask=d_ok, other=0.0).to(q.dtype).to(tl.float32)
            s = tl.load(SIN + P * s_cos + offs_d, mask=d_ok, other=0.0).to(q.dtype).to(tl.float32)
            q = _rotate(q, Q + b * sq_b, heads[:, None], sq_h, offs_d[None, :],
                        g_ok[:, None] & d_ok[None, :], c[None, :], s[None, :], D)
        m_i, l_i, acc = _softmax_init(BLOCK_G, BLOCK_D)
        if start < stop:
            m_i, l_i, acc = _softmax_block(q, k_first.to(q.dtype), v_first.to(q.dtype), n_ok, m_i, l_i,
                                           acc, scale, IEEE)
        for n0 in range(start + BLOCK_N, stop, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < stop
            kv_mask = n_ok[:, None] & d_ok[None, :]
            ptr = cache + offs_n[:, None].to(tl.int64) * sc_s + offs_d[None, :]
            k = tl.load(KC + ptr, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(VC + ptr, mask=kv_mask, other=0.0).to(q.dtype)
            m_i, l_i, acc = _softmax_block(q, k, v, n_ok, m_i, l_i, acc, scale, IEEE)
        if (P >= sp * split_len) & (P < (sp + 1) * split_len):  # this split owns slot pos
            kn = tl.load(K + b * sk_b + kvh * sk_h + offs_d, mask=d_ok, other=0.0)
            vn = tl.load(V + b * sv_b + kvh * sv_h + offs_d, mask=d_ok, other=0.0)
            if ROPE:
                kn = _rotate(kn, K + b * sk_b, kvh, sk_h, offs_d, d_ok, c, s, D)
            slot = cache + P.to(tl.int64) * sc_s + offs_d
            tl.store(KC + slot, kn.to(KC.dtype.element_ty), mask=d_ok)
            tl.store(VC + slot, vn.to(VC.dtype.element_ty), mask=d_ok)
            # the new key and value in the cache's precision, as the reference reads them back
            kn = kn.to(KC.dtype.element_ty).to(q.dtype).to(tl.float32)
            vn = vn.to(VC.dtype.element_ty).to(q.dtype).to(tl.float32)
            qk = tl.sum(q.to(tl.float32) * kn[None, :], 1) * scale
            m_new = tl.maximum(m_i, qk)
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * vn[None, :]
            m_i = m_new
        acc, lse = _softmax_result(acc, l_i, m_i)
        om = g_ok[:, None] & d_ok[None, :]
        if SPLIT:
            tl.store(MID_O + b * smo_s + heads[:, None] * smo_h + sp * smo_p + offs_d[None, :], acc,
                     mask=om)
            tl.store(MID_LSE + b * sml_s + heads * sml_h + sp, lse, mask=g_ok)
        else:
            tl.store(O + b * so_b + heads[:, None] * so_h + offs_d[None, :],
                     acc.to(O.dtype.element_ty), mask=om)


def static_splits(batch: int, n_kv: int, length: int, *, programs: int = 2 * 132, min_len: int = 64,
                  cap: int = 64) -> int:
    """Splits of a cache of `length` slots: about `programs` programs in all (two per SM of an
    H200 by default), none shorter than min_len slots, at most cap (the merge holds every split
    of a head in one tile).

    At batch 1 a program that walks its slots 64 at a time is bound by the latency of each
    step: SmolLM2's 3 KV heads over 384 slots take 5.3 us per layer in one split, 4.2 us in six
    (the reduce launch included; H200, scripts/gpu_attn_probe.py)."""
    want = cdiv(programs, max(1, batch * n_kv))
    return max(1, min(want, cdiv(length, min_len), cap))


def static_decode_triton(q, k, v, k_cache, v_cache, pos, scale: float, cos=None, sin=None,
                         num_splits: int | None = None, block_n: int | None = None,
                         num_warps: int = 4) -> torch.Tensor:
    q, k, v = split_qkv(q, k, v, k_cache)
    B, H, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape != (B, Hkv, S, D) or v_cache.shape != k_cache.shape or H % Hkv or \
            k.shape != (B, Hkv, D) or v.shape != k.shape:
        raise ValueError(f"static decode attention: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"cache {tuple(k_cache.shape)} disagree")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("static decode attention: the caches must be contiguous")
    rope = cos is not None
    if rope and (sin is None or cos.shape != sin.shape or cos.shape[-1] != D or D % 2
                 or cos.shape[0] < S or not (cos.is_contiguous() and sin.is_contiguous())):
        raise ValueError(f"static decode attention: rope tables {tuple(cos.shape)} do not cover "
                         f"{S} positions of head_dim {D}")
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)  # fused-qkv views read in place
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N = block_n or (64 if BLOCK_D <= 64 else 32)
    n = num_splits or static_splits(B, Hkv, S)
    split_len = cdiv(cdiv(S, n), BLOCK_N) * BLOCK_N
    n = cdiv(S, split_len)
    G = H // Hkv
    if n > 1:
        mid_o = torch.empty((B, H, n, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, H, n), dtype=torch.float32, device=q.device)
    else:
        mid_o, mid_lse = out, out  # unused (SPLIT=False); any tensors with the strides read
    tables = (cos, sin) if rope else (q, q)  # unused without ROPE
    pdl = pdl_enabled(q)
    extra = {"launch_pdl": True} if pdl else {}
    _static_decode_kernel[(B, Hkv, n)](
        q, k, v, k_cache, v_cache, pos, out, mid_o, mid_lse, *tables, scale, split_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0) if rope else 0,
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=BLOCK_D,
        BLOCK_N=BLOCK_N, SPLIT=n > 1, IEEE=q.dtype == torch.float32, ROPE=rope, PDL=pdl,
        num_warps=num_warps, **extra)
    if n > 1:
        _paged_decode_reduce_kernel[(B, H)](
            mid_o, mid_lse, out, n, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
            D=D, BLOCK_D=BLOCK_D, BLOCK_P=max(2, triton.next_power_of_2(n)), PDL=pdl, **extra)
    return out


if not registered("static_decode_attention"):
    @torch.library.custom_op("llmaccel::static_decode_attention", mutates_args=("k_cache", "v_cache"))
    def static_decode_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                                k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                                cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *,
                                scale: float) -> torch.Tensor:
        """(Rotate q, k at pos with the cos / sin tables,) write k, v (B, Hkv, D) at slot pos,
        then attend q (B, H, D) over slots 0 .. pos. k = v = None: q is (B, H + 2 Hkv, D)."""
        return static_decode_ref(q, k, v, k_cache, v_cache, pos, scale, cos, sin)

    @static_decode_attention.register_fake
    def _(q, k, v, k_cache, v_cache, pos, cos=None, sin=None, *, scale):
        B, H, D = split_qkv(q, k, v, k_cache)[0].shape
        return q.new_empty((B, H, D))

    if triton is not None:
        @static_decode_attention.register_kernel("cuda")
        def _(q, k, v, k_cache, v_cache, pos, cos=None, sin=None, *, scale):
            return static_decode_triton(q, k, v, k_cache, v_cache, pos, scale, cos, sin)
