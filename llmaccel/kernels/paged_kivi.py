"""Decode attention over the paged KIVI cache (llmaccel.runtime.kivi_cache): one query token per
sequence over its packed blocks (dequantized) and then its full-precision blocks.

Cache layout (blocks of G tokens, G = the key group):
    kp, vp (NQ, Hkv, G, D*bits/8) uint8   ks, km (NQ, Hkv, D)   vs, vm (NQ, Hkv, G, D/VG)
    fk, fv (NF, G, Hkv, D)
block_tables (S, W) int32: logical block i of sequence s is packed block bt[s, i] when
i < n_packed[s], else fp block bt[s, i]; context_lens (S,) tokens. The new token's K/V and any
group that ages in the step are written before this op runs (it does not mutate the cache).

    llmaccel::paged_kivi_decode(q (S, H, D), kp, ks, km, vp, vs, vm, fk, fv, block_tables,
                                n_packed, context_lens, *, scale, bits, group, value_group)
CPU: the reference; CUDA: Triton split-K (flash-decoding) over whole blocks, every query head
of a KV head in one program, the splits merged by llmaccel.kernels.kivi's combine kernel.
Dequantized keys and values are rounded to the cache dtype as the reference does.
"""
from __future__ import annotations

import torch

from llmaccel.ops.attention import attend_heads
from llmaccel.ops.kvquant import dequantize_keys, dequantize_values

try:
    import triton
    import triton.language as tl

    from llmaccel.kernels.kivi import _kivi_combine_kernel, _online_softmax_step
except ImportError:  # every non-kernel path works without triton
    triton = None

HAS_TRITON = triton is not None


def paged_kivi_decode_ref(q, kp, ks, km, vp, vs, vm, fk, fv, block_tables, n_packed, context_lens, *,
                          scale: float, bits: int, group: int, value_group: int) -> torch.Tensor:
    S, H, D = q.shape
    W = block_tables.shape[1]
    bt = block_tables.long()
    packed = torch.arange(W, device=q.device)[None, :] < n_packed.to(q.device).long()[:, None]  # (S, W)
    pid = torch.where(packed, bt, 0).clamp(max=kp.shape[0] - 1)
    fid = torch.where(packed, 0, bt).clamp(max=fk.shape[0] - 1)
    kq = dequantize_keys(kp[pid], ks[pid][:, :, :, None], km[pid][:, :, :, None], bits, group)
    vq = dequantize_values(vp[pid], vs[pid], vm[pid], bits, value_group)  # (S, W, Hkv, G, D)
    sel = packed[:, :, None, None, None]
    k = torch.where(sel, kq.transpose(2, 3), fk[fid])  # (S, W, G, Hkv, D)
    v = torch.where(sel, vq.transpose(2, 3), fv[fid])
    Hkv = k.shape[3]
    k = k.reshape(S, W * group, Hkv, D).transpose(1, 2).to(q.dtype)
    v = v.reshape(S, W * group, Hkv, D).transpose(1, 2).to(q.dtype)
    mask = torch.arange(W * group, device=q.device)[None, :] < context_lens.to(q.device)[:, None]
    return attend_heads(q[:, :, None, :], k, v, scale=scale, mask=mask[:, None, None, :])[:, :, 0]


if HAS_TRITON:
    @triton.jit
    def _paged_kivi_decode_kernel(q_ptr, kp_ptr, ks_ptr, km_ptr, vp_ptr, vs_ptr, vm_ptr, fk_ptr,
                                  fv_ptr, bt_ptr, nqb_ptr, len_ptr, acc_ptr, ml_ptr, scale, GQ, BPS,
                                  sq_s, sq_h, sbt, sp_b, sp_h, sp_t, sks_b, sks_h,
                                  svs_b, svs_h, svs_t, sf_b, sf_t, sf_h, sa_b, sa_h, sa_s, sa_g,
                                  BITS: tl.constexpr, G: tl.constexpr, VG: tl.constexpr,
                                  D: tl.constexpr, BLOCK_H: tl.constexpr):
        # One program: the GQ query heads of one KV head over BPS blocks of one sequence.
        PER: tl.constexpr = 8 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        s, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        L = tl.load(len_ptr + s)
        nqb = tl.load(nqb_ptr + s)
        oh = tl.arange(0, BLOCK_H)
        od = tl.arange(0, D)
        ot = tl.arange(0, G)
        q = tl.load(q_ptr + s * sq_s + (h * GQ + oh)[:, None] * sq_h + od[None, :],
                    mask=(oh < GQ)[:, None], other=0.0).to(tl.float32) * scale
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        byte_d = (od // PER)[None, :]
        shift_d = ((od % PER) * BITS)[None, :]
        b_lo = sp * BPS
        b_hi = tl.minimum(b_lo + BPS, tl.cdiv(L, G))
        for blk in range(b_lo, b_hi):
            bid = tl.load(bt_ptr + s * sbt + blk).to(tl.int64)
            valid = blk * G + ot < L
            if blk < nqb:
                pb = bid * sp_b + h * sp_h + ot[:, None] * sp_t + byte_d
                kc = ((tl.load(kp_ptr + pb).to(tl.int32) >> shift_d) & MASK).to(tl.float32)
                ksc = tl.load(ks_ptr + bid * sks_b + h * sks_h + od).to(tl.float32)
                kmn = tl.load(km_ptr + bid * sks_b + h * sks_h + od).to(tl.float32)
                k = (kc * ksc[None, :] + kmn[None, :]).to(ks_ptr.dtype.element_ty).to(tl.float32)
                vc = ((tl.load(vp_ptr + pb).to(tl.int32) >> shift_d) & MASK).to(tl.float32)
                vgi = bid * svs_b + h * svs_h + ot[:, None] * svs_t + (od // VG)[None, :]
                vsc = tl.load(vs_ptr + vgi).to(tl.float32)
                vmn = tl.load(vm_ptr + vgi).to(tl.float32)
                v = (vc * vsc + vmn).to(vs_ptr.dtype.element_ty).to(tl.float32)
            else:
                fb = bid * sf_b + ot[:, None] * sf_t + h * sf_h + od[None, :]
                k = tl.load(fk_ptr + fb, mask=valid[:, None], other=0.0).to(tl.float32)
                v = tl.load(fv_ptr + fb, mask=valid[:, None], other=0.0).to(tl.float32)
            m_i, l_i, acc = _online_softmax_step(q, k, v, valid, m_i, l_i, acc)
        base = s * sa_b + h * sa_h + sp * sa_s + oh * sa_g
        tl.store(acc_ptr + base[:, None] * D + od[None, :], acc)
        tl.store(ml_ptr + base * 2, m_i)
        tl.store(ml_ptr + base * 2 + 1, l_i)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def paged_kivi_decode_triton(q, kp, ks, km, vp, vs, vm, fk, fv, block_tables, n_packed, context_lens,
                             *, scale: float, bits: int, group: int, value_group: int,
                             target_programs: int = 264) -> torch.Tensor:
    S, H, D = q.shape
    Hkv, W = kp.shape[1], block_tables.shape[1]
    if H % Hkv or not (_pow2(D) and _pow2(group)) or kp.shape[2] != group or fk.shape[1:] != (group, Hkv, D):
        raise ValueError(f"paged kivi decode: q {tuple(q.shape)} does not match the cache "
                         f"(packed {tuple(kp.shape)}, fp {tuple(fk.shape)}); needs power-of-two D and G")
    gq = H // Hkv
    out = torch.empty_like(q)
    if S == 0:
        return out
    # Splits from shapes only (the table width), so a captured CUDA graph replays at any length.
    ns = max(1, min(W, triton.cdiv(target_programs, S * Hkv)))
    bps = triton.cdiv(W, ns)
    ns = triton.cdiv(W, bps)
    bh = max(2, triton.next_power_of_2(gq))
    acc = torch.empty(S, Hkv, ns, bh, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(S, Hkv, ns, bh, 2, dtype=torch.float32, device=q.device)
    sa = (Hkv * ns * bh, ns * bh, bh, 1)
    q = q.contiguous()
    bt = block_tables.to(torch.int32).contiguous()
    nqb, lens = n_packed.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    _paged_kivi_decode_kernel[(S, Hkv, ns)](
        q, kp, ks, km, vp, vs, vm, fk, fv, bt, nqb, lens, acc, ml, scale, gq, bps,
        q.stride(0), q.stride(1), bt.stride(0), kp.stride(0), kp.stride(1), kp.stride(2),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), vs.stride(2),
        fk.stride(0), fk.stride(1), fk.stride(2), *sa,
        BITS=bits, G=group, VG=value_group, D=D, BLOCK_H=bh)
    _kivi_combine_kernel[(S, H)](acc, ml, out, gq, ns, out.stride(0), out.stride(1), *sa,
                                 D=D, BLOCK_S=max(2, triton.next_power_of_2(ns)))
    return out


@torch.library.custom_op("llmaccel::paged_kivi_decode", mutates_args=())
def paged_kivi_decode(q: torch.Tensor, kp: torch.Tensor, ks: torch.Tensor, km: torch.Tensor,
                      vp: torch.Tensor, vs: torch.Tensor, vm: torch.Tensor, fk: torch.Tensor,
                      fv: torch.Tensor, block_tables: torch.Tensor, n_packed: torch.Tensor,
                      context_lens: torch.Tensor, *, scale: float, bits: int, group: int,
                      value_group: int) -> torch.Tensor:
    return paged_kivi_decode_ref(q, kp, ks, km, vp, vs, vm, fk, fv, block_tables, n_packed,
                                 context_lens, scale=scale, bits=bits, group=group,
                                 value_group=value_group)


@paged_kivi_decode.register_fake
def _(q, kp, ks, km, vp, vs, vm, fk, fv, block_tables, n_packed, context_lens, *, scale, bits,
      group, value_group):
    return torch.empty_like(q)


if HAS_TRITON:
    @paged_kivi_decode.register_kernel("cuda")
    def _(q, kp, ks, km, vp, vs, vm, fk, fv, block_tables, n_packed, context_lens, *, scale, bits,
          group, value_group):
        return paged_kivi_decode_triton(q, kp, ks, km, vp, vs, vm, fk, fv, block_tables, n_packed,
                                        context_lens, scale=scale, bits=bits, group=group,
                                        value_group=value_group)
