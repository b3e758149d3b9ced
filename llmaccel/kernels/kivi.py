"""KIVI kernels: quantize-and-pack for keys and values, and decode attention over the
quantized cache plus its full-precision residual. The format is the one llmaccel.ops.kvquant
defines (and whose functions are the references here).

Custom ops (CPU: the reference; CUDA: Triton):
    llmaccel::kivi_quantize_keys(k (N, T, D), bits, group)        -> packed, scale, min
    llmaccel::kivi_quantize_values(v (N, T, D), bits, group)      -> packed, scale, min
    llmaccel::kivi_decode_attention(q, kp, ks, km, vp, vs, vm, kr, vr, n_quant, n_res, ...) -> out
Token counts are tensors so that a captured decode step (CUDA graph) replays at any length.
The Triton paths need power-of-two head_dim, group sizes and token group. Divisions are
IEEE-rounded (div_rn) so that scales and codes match the reference bit for bit except at
rounding ties, where a fused multiply-add may move a code by one step.
"""
from __future__ import annotations

import torch

from llmaccel.ops.kvquant import decode_attention_ref, quantize_keys, quantize_values

try:
    import triton
    import triton.language as tl
except ImportError:  # every non-kernel path works without triton
    triton = None

HAS_TRITON = triton is not None


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


if HAS_TRITON:
    @triton.jit
    def _scale_min(mn, mx, QMAX: tl.constexpr, SDT: tl.constexpr):
        """Asymmetric scale and min of the range [mn, mx] rounded to the cache's dtype SDT, and
        the reciprocal of the rounded scale (0 where the range is empty): codes are taken from
        the stored values, as the reference takes them."""
        scale = tl.div_rn(mx - mn, tl.full(mn.shape, QMAX, tl.float32)).to(SDT)
        mn = mn.to(SDT)
        s32 = scale.to(tl.float32)
        inv = tl.where(s32 > 0, tl.div_rn(s32 * 0.0 + 1.0, tl.where(s32 > 0, s32, 1.0)), 0.0)
        return scale, mn, inv

    @triton.jit
    def _packed(x, mn, inv, shifts, AXIS: tl.constexpr, QMAX: tl.constexpr):
        """The codes of x (mn and inv broadcast to it) as bytes: those along AXIS ORed together
        at their shifts."""
        code = tl.minimum(tl.maximum(tl.floor((x - mn.to(tl.float32)) * inv + 0.5), 0.0), QMAX)
        return tl.sum(code.to(tl.int32) << shifts, axis=AXIS).to(tl.uint8)

    @triton.jit
    def _quantize_keys_kernel(x_ptr, p_ptr, s_ptr, m_ptr, sx_n, sx_t, sp_n, sp_t, ss_n, ss_g,
                              BITS: tl.constexpr, G: tl.constexpr, DP: tl.constexpr):
        # One program: G tokens x D channels of one (sequence, head); min/max per channel.
        PER: tl.constexpr = 8 // BITS
        QMAX: tl.constexpr = (1 << BITS) - 1
        n, g = tl.program_id(0), tl.program_id(1)
        t = g * G + tl.arange(0, G)[:, None, None]
        j = tl.arange(0, DP)[None, :, None]
        i = tl.arange(0, PER)[None, None, :]
        x = tl.load(x_ptr + n * sx_n + t * sx_t + j * PER + i).to(tl.float32)  # (G, DP, PER)
        scale, mn, inv = _scale_min(tl.min(x, axis=0), tl.max(x, axis=0), QMAX, s_ptr.dtype.element_ty)
        sc = tl.arange(0, DP)[:, None] * PER + tl.arange(0, PER)[None, :]
        tl.store(s_ptr + n * ss_n + g * ss_g + sc, scale)
        tl.store(m_ptr + n * ss_n + g * ss_g + sc, mn)
        byte = _packed(x, mn[None], inv[None], i * BITS, 2, QMAX)  # (G, DP)
        tl.store(p_ptr + n * sp_n + (g * G + tl.arange(0, G)[:, None]) * sp_t
                 + tl.arange(0, DP)[None, :], byte)

    @triton.jit
    def _quantize_values_kernel(x_ptr, p_ptr, s_ptr, m_ptr, T, sx_n, sx_t, sp_n, sp_t, ss_n, ss_t,
                                BITS: tl.constexpr, NG: tl.constexpr, GP: tl.constexpr,
                                BLOCK_T: tl.constexpr):
        # One program: BLOCK_T tokens of one (sequence, head); min/max per token and channel group.
        PER: tl.constexpr = 8 // BITS
        QMAX: tl.constexpr = (1 << BITS) - 1
        n, tb = tl.program_id(0), tl.program_id(1)
        t4 = tb * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None, None]
        g4 = tl.arange(0, NG)[None, :, None, None]
        j4 = tl.arange(0, GP)[None, None, :, None]
        i4 = tl.arange(0, PER)[None, None, None, :]
        x = tl.load(x_ptr + n * sx_n + t4 * sx_t + (g4 * GP + j4) * PER + i4, mask=t4 < T,
                    other=0.0).to(tl.float32)  # (BLOCK_T, NG, GP, PER)
        scale, mn, inv = _scale_min(tl.min(tl.min(x, axis=3), axis=2), tl.max(tl.max(x, axis=3), axis=2),
                                    QMAX, s_ptr.dtype.element_ty)
        t2 = tb * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        g2 = tl.arange(0, NG)[None, :]
        tl.store(s_ptr + n * ss_n + t2 * ss_t + g2, scale, mask=t2 < T)
        tl.store(m_ptr + n * ss_n + t2 * ss_t + g2, mn, mask=t2 < T)
        byte = _packed(x, mn[:, :, None, None], inv[:, :, None, None], i4 * BITS, 3, QMAX)  # (BLOCK_T, NG, GP)
        t3 = tb * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
        b3 = tl.arange(0, NG)[None, :, None] * GP + tl.arange(0, GP)[None, None, :]
        tl.store(p_ptr + n * sp_n + t3 * sp_t + b3, byte, mask=t3 < T)

    @triton.jit
    def _online_softmax_step(q, k, v, valid, m_i, l_i, acc):
        sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (BLOCK_H, BLOCK_N)
        sc = tl.where(valid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        return m_new, l_i, acc

    @triton.jit
    def _kivi_decode_kernel(q_ptr, kp_ptr, ks_ptr, km_ptr, vp_ptr, vs_ptr, vm_ptr, kr_ptr, vr_ptr,
                            nq_ptr, nr_ptr, acc_ptr, ml_ptr, scale, GQ, SPLIT,
                            sq_b, sq_h, sp_b, sp_h, sp_t, sks_b, sks_h, sks_g,
                            svs_b, svs_h, svs_t, sr_b, sr_h, sr_t, sa_b, sa_h, sa_s, sa_g,
                            BITS: tl.constexpr, G: tl.constexpr, VG: tl.constexpr,
                            D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        # One program: the GQ query heads of one KV head over one split of the quantized tokens,
        # or (the last split) over the residual tokens. Writes an unnormalised partial result.
        PER: tl.constexpr = 8 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        is_res = s == tl.num_programs(2) - 1
        oh = tl.arange(0, BLOCK_H)
        od = tl.arange(0, D)
        q = tl.load(q_ptr + b * sq_b + (h * GQ + oh)[:, None] * sq_h + od[None, :],
                    mask=(oh < GQ)[:, None], other=0.0).to(tl.float32) * scale
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        # Quantized tokens [lo, hi): empty for the residual program.
        lo = s * SPLIT
        hi = tl.where(is_res, lo, tl.minimum(lo + SPLIT, tl.load(nq_ptr + b)))
        byte_d = (od // PER)[None, :]
        shift_d = ((od % PER) * BITS)[None, :]
        for n0 in range(lo, hi, BLOCK_N):
            on = n0 + tl.arange(0, BLOCK_N)
            nm = (on < hi)[:, None]
            pk = tl.load(kp_ptr + b * sp_b + h * sp_h + on[:, None] * sp_t + byte_d, mask=nm, other=0)
            kg = (on // G)[:, None] * sks_g + od[None, :]
            ksc = tl.load(ks_ptr + b * sks_b + h * sks_h + kg, mask=nm, other=0.0).to(tl.float32)
            kmn = tl.load(km_ptr + b * sks_b + h * sks_h + kg, mask=nm, other=0.0).to(tl.float32)
            k = ((pk.to(tl.int32) >> shift_d) & MASK).to(tl.float32) * ksc + kmn
            pv = tl.load(vp_ptr + b * sp_b + h * sp_h + on[:, None] * sp_t + byte_d, mask=nm, other=0)
            vg = on[:, None] * svs_t + (od // VG)[None, :]
            vsc = tl.load(vs_ptr + b * svs_b + h * svs_h + vg, mask=nm, other=0.0).to(tl.float32)
            vmn = tl.load(vm_ptr + b * svs_b + h * svs_h + vg, mask=nm, other=0.0).to(tl.float32)
            v = ((pv.to(tl.int32) >> shift_d) & MASK).to(tl.float32) * vsc + vmn
            m_i, l_i, acc = _online_softmax_step(q, k, v, on < hi, m_i, l_i, acc)
        # Full-precision residual tokens [0, n_res): only the last program reads them.
        r_hi = tl.where(is_res, tl.load(nr_ptr + b), 0)
        for n0 in range(0, r_hi, BLOCK_N):
            on = n0 + tl.arange(0, BLOCK_N)
            nm = (on < r_hi)[:, None]
            rp = b * sr_b + h * sr_h + on[:, None] * sr_t + od[None, :]
            k = tl.load(kr_ptr + rp, mask=nm, other=0.0).to(tl.float32)
            v = tl.load(vr_ptr + rp, mask=nm, other=0.0).to(tl.float32)
            m_i, l_i, acc = _online_softmax_step(q, k, v, on < r_hi, m_i, l_i, acc)
        base = b * sa_b + h * sa_h + s * sa_s + oh * sa_g
        tl.store(acc_ptr + base[:, None] * D + od[None, :], acc)
        tl.store(ml_ptr + base * 2, m_i)
        tl.store(ml_ptr + base * 2 + 1, l_i)

    @triton.jit
    def _kivi_combine_kernel(acc_ptr, ml_ptr, o_ptr, GQ, NS, so_b, so_h, sa_b, sa_h, sa_s, sa_g,
                             D: tl.constexpr, BLOCK_S: tl.constexpr):
        # One program per (sequence, query head): merge the splits' partial softmax results.
        b, hq = tl.program_id(0), tl.program_id(1)
        h, gi = hq // GQ, hq % GQ
        os_ = tl.arange(0, BLOCK_S)
        od = tl.arange(0, D)
        base = b * sa_b + h * sa_h + os_ * sa_s + gi * sa_g
        sm = os_ < NS
        m = tl.load(ml_ptr + base * 2, mask=sm, other=float("-inf"))
        l = tl.load(ml_ptr + base * 2 + 1, mask=sm, other=0.0)
        a = tl.load(acc_ptr + base[:, None] * D + od[None, :], mask=sm[:, None], other=0.0)
        mx = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - mx), 0.0)
        out = tl.sum(w[:, None] * a, axis=0) / tl.sum(w * l, axis=0)
        tl.store(o_ptr + b * so_b + hq * so_h + od, out.to(o_ptr.dtype.element_ty))


def _check_keys(x: torch.Tensor, bits: int, group: int) -> None:
    if x.dim() != 3 or x.shape[1] % group or x.shape[2] % (8 // bits):
        raise ValueError(f"kivi: keys of shape {tuple(x.shape)} do not split into groups of "
                         f"{group} tokens packed {8 // bits} per byte")


def quantize_keys_triton(k: torch.Tensor, bits: int, group: int):
    _check_keys(k, bits, group)
    N, T, D = k.shape
    if not (_pow2(group) and _pow2(D)):
        raise ValueError("kivi: the Triton path needs power-of-two group and head_dim")
    k = k.contiguous()
    packed = torch.empty(N, T, D * bits // 8, dtype=torch.uint8, device=k.device)
    scale = torch.empty(N, T // group, D, dtype=k.dtype, device=k.device)
    mn = torch.empty_like(scale)
    _quantize_keys_kernel[(N, T // group)](k, packed, scale, mn, k.stride(0), k.stride(1),
                                            packed.stride(0), packed.stride(1), scale.stride(0),
                                            scale.stride(1), BITS=bits, G=group, DP=D * bits // 8)
    return packed, scale, mn


def quantize_values_triton(v: torch.Tensor, bits: int, group: int):
    N, T, D = v.shape
    per = 8 // bits
    if D % group or group % per or not (_pow2(group) and _pow2(D)):
        raise ValueError(f"kivi: values of head_dim {D} need power-of-two groups of {group} "
                         f"channels, a multiple of {per}")
    v = v.contiguous()
    packed = torch.empty(N, T, D * bits // 8, dtype=torch.uint8, device=v.device)
    scale = torch.empty(N, T, D // group, dtype=v.dtype, device=v.device)
    mn = torch.empty_like(scale)
    block_t = 16
    _quantize_values_kernel[(N, triton.cdiv(T, block_t))](
        v, packed, scale, mn, T, v.stride(0), v.stride(1), packed.stride(0), packed.stride(1),
        scale.stride(0), scale.stride(1), BITS=bits, NG=D // group, GP=group // per, BLOCK_T=block_t)
    return packed, scale, mn


def decode_attention_triton(q, kp, ks, km, vp, vs, vm, kr, vr, n_quant, n_res, *, scale: float,
                            bits: int, group: int, value_group: int, block_n: int = 32,
                            target_programs: int = 264) -> torch.Tensor:
    B, H, D = q.shape
    Hkv, Sq = kp.shape[1], kp.shape[2]
    if H % Hkv or not _pow2(D) or kp.shape[3] * 8 // bits != D or kr.shape[3] != D:
        raise ValueError(f"kivi decode: q {tuple(q.shape)} does not match the cache {tuple(kp.shape)}")
    gq = H // Hkv
    # Split the quantized tokens so that B * Hkv * splits fills the GPU (flash-decoding);
    # the extra last split reads the residual.
    ns = max(1, min(triton.cdiv(max(Sq, 1), block_n), triton.cdiv(target_programs, B * Hkv)))
    split = triton.cdiv(triton.cdiv(max(Sq, 1), ns), block_n) * block_n
    ns = triton.cdiv(max(Sq, 1), split) + 1
    bh = triton.next_power_of_2(gq)
    acc = torch.empty(B, Hkv, ns, bh, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(B, Hkv, ns, bh, 2, dtype=torch.float32, device=q.device)
    q, kp, vp, kr, vr = (t.contiguous() for t in (q, kp, vp, kr, vr))
    ks, km, vs, vm = (t.contiguous() for t in (ks, km, vs, vm))
    nq, nr = n_quant.to(torch.int32).contiguous(), n_res.to(torch.int32).contiguous()
    sa = (Hkv * ns * bh, ns * bh, bh, 1)
    _kivi_decode_kernel[(B, Hkv, ns)](
        q, kp, ks, km, vp, vs, vm, kr, vr, nq, nr, acc, ml, scale, gq, split,
        q.stride(0), q.stride(1), kp.stride(0), kp.stride(1), kp.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        kr.stride(0), kr.stride(1), kr.stride(2), *sa,
        BITS=bits, G=group, VG=value_group, D=D, BLOCK_H=bh, BLOCK_N=block_n)
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    _kivi_combine_kernel[(B, H)](acc, ml, out, gq, ns, out.stride(0), out.stride(1), *sa,
                                 D=D, BLOCK_S=triton.next_power_of_2(ns))
    return out


# --- custom ops ---------------------------------------------------------------------------------

@torch.library.custom_op("llmaccel::kivi_quantize_keys", mutates_args=())
def kivi_quantize_keys(k: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_keys(k, bits, group)
    return tuple(t.contiguous() for t in quantize_keys(k, bits, group))


@kivi_quantize_keys.register_fake
def _(k, bits, group):
    N, T, D = k.shape
    return (k.new_empty(N, T, D * bits // 8, dtype=torch.uint8), k.new_empty(N, T // group, D),
            k.new_empty(N, T // group, D))


@torch.library.custom_op("llmaccel::kivi_quantize_values", mutates_args=())
def kivi_quantize_values(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.contiguous() for t in quantize_values(v, bits, group))


@kivi_quantize_values.register_fake
def _(v, bits, group):
    N, T, D = v.shape
    return (v.new_empty(N, T, D * bits // 8, dtype=torch.uint8), v.new_empty(N, T, D // group),
            v.new_empty(N, T, D // group))


@torch.library.custom_op("llmaccel::kivi_decode_attention", mutates_args=())
def kivi_decode_attention(q: torch.Tensor, kp: torch.Tensor, ks: torch.Tensor, km: torch.Tensor,
                          vp: torch.Tensor, vs: torch.Tensor, vm: torch.Tensor, kr: torch.Tensor,
                          vr: torch.Tensor, n_quant: torch.Tensor, n_res: torch.Tensor, scale: float,
                          bits: int, group: int, value_group: int) -> torch.Tensor:
    return decode_attention_ref(q, kp, ks, km, vp, vs, vm, kr, vr, n_quant, n_res, scale=scale,
                                bits=bits, group=group, value_group=value_group)


@kivi_decode_attention.register_fake
def _(q, kp, ks, km, vp, vs, vm, kr, vr, n_quant, n_res, scale, bits, group, value_group):
    return torch.empty_like(q)


if HAS_TRITON:
    kivi_quantize_keys.register_kernel("cuda")(quantize_keys_triton)
    kivi_quantize_values.register_kernel("cuda")(quantize_values_triton)

    @kivi_decode_attention.register_kernel("cuda")
    def _(q, kp, ks, km, vp, vs, vm, kr, vr, n_quant, n_res, scale, bits, group, value_group):
        return decode_attention_triton(q, kp, ks, km, vp, vs, vm, kr, vr, n_quant, n_res,
                                       scale=scale, bits=bits, group=group, value_group=value_group)
