"""Decode attention over a static KIVI-quantized KV cache, with the KV write and the ageing of a
group into the quantized store folded in (one launch per layer, plus the split merge).

Cache layout per layer (codegen/static_cache.py), in llmaccel.ops.kvquant's format:
  kp, vp (B, Hkv, Sq, D * bits / 8) uint8   codes of tokens 0 .. Sq - 1, packed along head_dim
  ks, km (B, Hkv, Sq / G, D)                per-channel key scale and min of each G tokens
  vs, vm (B, Hkv, Sq, D / VG)               per-token value scale and min of each VG channels
  kr, vr (B, Hkv, R + G, D)                 the full-precision tokens: token t at slot t % (R + G)
Every row of the static batch decodes at the same position. As in the reference cache
(ops.kvquant.QuantizedKVCache), once L tokens are stored the first quantized_len(L) =
G * floor(max(0, L - R) / G) of them are read quantized and the rest in full precision; the ring
of R + G slots holds every token not yet quantized (at most R + G - 1 of them after a write).

  llmaccel::static_kivi_decode(q (B, H, D), k, v (B, Hkv, D), kp, ks, km, vp, vs, vm, kr, vr,
                               pos, *, scale, bits, group, value_group, residual) -> (B, H, D)
      writes k, v (token pos, already rotated) into the ring; when token pos makes a group age
      (quantized_len(pos + 1) > quantized_len(pos)), quantizes that group into the store; then
      attends q over tokens 0 .. pos, quantized ones dequantized in the cache's dtype.
  static_kivi_prefill(k, v (B, Hkv, T, D), kp, ..., vr, spec) -> (keys, values) (B, Hkv, T, D)
      fills an empty cache with tokens 0 .. T - 1 and returns them as the reference cache
      reads them back (what the prompt's own attention sees there).

At long context a bf16 cache is most of the bytes a decode step reads; at 2 bits with G = VG =
16 each token costs 64 bytes per KV head of 64 channels instead of 256. The Triton kernel: one
program per (row, KV head, split) walks its split of the quantized store BLOCK_N tokens at a
time, the codes loaded as 32-bit words (16 two-bit codes each) and unpacked in registers, the
scales applied per group, the GQA group's query heads as rows of one tensor-core tile; an extra
program per (row, KV head) writes the new token, quantizes an ageing group (it alone writes
the store this step; the split programs read only groups quantized before it), and attends over
that group and the ring. Splits are merged by log-sum-exp (the paged kernel's reduce).
CPU implementation: the reference; CUDA: Triton (power-of-two head_dim >= 16 and groups).
"""
from __future__ import annotations

import torch

from llmaccel.kernels import cdiv, pdl_enabled, registered, sm_count, unit_stride
from llmaccel.kernels.static_attention import static_splits
from llmaccel.ops.kvquant import (decode_attention_ref, dequantize_keys, dequantize_values,
                                  quantize_keys, quantize_values, quantized_len)

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton
    triton = None

CACHE_NAMES = ("kp", "ks", "km", "vp", "vs", "vm", "kr", "vr")


def cache_shapes(batch: int, n_kv: int, head_dim: int, max_len: int, spec: dict) -> dict[str, tuple]:
    """Shapes of one layer's buffers, by CACHE_NAMES; the store holds whole groups only."""
    b, g, vg, r = spec["bits"], spec["group"], spec["value_group"], spec["residual"]
    sq = max_len - max_len % g
    lead = (batch, n_kv)
    return {"kp": (*lead, sq, head_dim * b // 8), "ks": (*lead, sq // g, head_dim),
            "km": (*lead, sq // g, head_dim), "vp": (*lead, sq, head_dim * b // 8),
            "vs": (*lead, sq, head_dim // vg), "vm": (*lead, sq, head_dim // vg),
            "kr": (*lead, r + g, head_dim), "vr": (*lead, r + g, head_dim)}


def _spec(bits, group, value_group, residual) -> dict:
    return {"bits": bits, "group": group, "value_group": value_group, "residual": residual}


def _age(kp, ks, km, vp, vs, vm, kr, vr, first: int, spec: dict) -> None:
    """Quantize the group of tokens first .. first + G - 1 from the ring into the store."""
    b, g, vg = spec["bits"], spec["group"], spec["value_group"]
    slots = torch.arange(first, first + g, device=kr.device) % kr.shape[2]
    kp[:, :, first:first + g], s, m = quantize_keys(kr[:, :, slots], b, g)
    ks[:, :, first // g], km[:, :, first // g] = s[:, :, 0], m[:, :, 0]
    vp[:, :, first:first + g], vs[:, :, first:first + g], vm[:, :, first:first + g] = \
        quantize_values(vr[:, :, slots], b, vg)


def static_kivi_decode_ref(q, k, v, kp, ks, km, vp, vs, vm, kr, vr, pos, *, scale: float, bits: int,
                           group: int, value_group: int, residual: int) -> torch.Tensor:
    """Reference: write token pos into the ring, age a group if it is due, then attend over the
    dequantized store and the ring (ops.kvquant.decode_attention_ref)."""
    spec = _spec(bits, group, value_group, residual)
    P = int(pos.reshape(-1)[0])
    ring = kr.shape[2]
    kr[:, :, P % ring] = k.to(kr.dtype)
    vr[:, :, P % ring] = v.to(vr.dtype)
    nq0, nq = quantized_len(P, spec), quantized_len(P + 1, spec)
    if nq > nq0:
        _age(kp, ks, km, vp, vs, vm, kr, vr, nq - group, spec)
    res = torch.arange(nq, P + 1, device=kr.device) % ring
    B = q.shape[0]
    n_quant = torch.full((B,), nq, dtype=torch.int32)
    n_res = torch.full((B,), P + 1 - nq, dtype=torch.int32)
    return decode_attention_ref(q, kp, ks, km, vp, vs, vm, kr[:, :, res], vr[:, :, res], n_quant, n_res,
                                scale=scale, bits=bits, group=group, value_group=value_group)


def static_kivi_prefill(k, v, kp, ks, km, vp, vs, vm, kr, vr, spec: dict):
    """Store tokens 0 .. T - 1 (k, v of shape (B, Hkv, T, D)) in an empty cache: whole groups
    past the residual quantized (llmaccel::kivi_quantize_*: Triton on CUDA), the rest in the ring.
    Returns the keys and values as the reference cache reads them back, dequantized in the
    cache's dtype where quantized."""
    b, g, vg = spec["bits"], spec["group"], spec["value_group"]
    B, Hkv, T, D = k.shape
    nq = quantized_len(T, spec)
    k, v = k.to(kr.dtype), v.to(vr.dtype)
    res = torch.arange(nq, T, device=k.device) % kr.shape[2]
    kr.index_copy_(2, res, k[:, :, nq:])
    vr.index_copy_(2, res, v[:, :, nq:])
    if nq == 0:
        return k, v
    pk, sk, mk = torch.ops.llmaccel.kivi_quantize_keys(k[:, :, :nq].reshape(B * Hkv, nq, D), b, g)
    pv, sv, mv = torch.ops.llmaccel.kivi_quantize_values(v[:, :, :nq].reshape(B * Hkv, nq, D), b, vg)
    for dst, src in ((kp, pk), (ks, sk), (km, mk), (vp, pv), (vs, sv), (vm, mv)):
        dst[:, :, :src.shape[1]].copy_(src.view(B, Hkv, *src.shape[1:]))
    kq = dequantize_keys(pk, sk, mk, b, g).view(B, Hkv, nq, D)
    vq = dequantize_values(pv, sv, mv, b, vg).view(B, Hkv, nq, D)
    return torch.cat([kq, k[:, :, nq:]], 2), torch.cat([vq, v[:, :, nq:]], 2)


if triton is not None:
    from triton.language.extra import cuda as _tl_cuda

    from llmaccel.kernels.kivi import _packed, _scale_min
    from llmaccel.kernels.paged_attention import (_group_queries, _paged_decode_reduce_kernel,
                                                  _softmax_block, _softmax_init, _softmax_result)
    from llmaccel.kernels.quant_linear import _int4_words, _interleave8, _nib

    @triton.jit
    def _crumb(w, SHIFT: tl.constexpr):
        """The 2-bit field at bit SHIFT (< 22) of each word as an exact fp32 integer (quant_linear's
        nibble read, with a 2-bit mask)."""
        return _nib(w, 3 << SHIFT, 1.0 / (1 << SHIFT), 0.0)

    @triton.jit
    def _interleave16(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
        """(..., W) x 16 -> (..., W, 2, 2, 2, 2) whose flattening puts c0 .. c15 in order."""
        return tl.join(_interleave8(c0, c2, c4, c6, c8, c10, c12, c14),
                       _interleave8(c1, c3, c5, c7, c9, c11, c13, c15))

    @triton.jit
    def _codes(words, BITS: tl.constexpr):
        """Codes (N, D) as exact fp32 of token rows of 32-bit words (N, D * BITS / 32): channel
        w * (32 / BITS) + i sits in bits [i * BITS, (i + 1) * BITS) of word w (ops.kvquant's
        byte packing read four bytes at a time, little-endian). Each word's codes come out in
        the thread that loaded it (two ops per code: no shift, no int-to-float conversion, which
        runs at a quarter rate on the GPU) and are joined in registers."""
        N: tl.constexpr = words.shape[0]
        DW: tl.constexpr = words.shape[1]
        if BITS == 4:
            n0, n1, n2, n3, n4, n5, n6, n7 = _int4_words(words, 0.0)
            return tl.reshape(_interleave8(n0, n1, n2, n3, n4, n5, n6, n7), (N, DW * 8))
        hi = words >> 12  # fields 11 .. 15 would reach the exponent bits in place
        return tl.reshape(_interleave16(
            _crumb(words, 0), _crumb(words, 2), _crumb(words, 4), _crumb(words, 6), _crumb(words, 8),
            _crumb(words, 10), _crumb(words, 12), _crumb(words, 14), _crumb(words, 16),
            _crumb(words, 18), _crumb(words, 20), _crumb(hi, 10), _crumb(hi, 12), _crumb(hi, 14),
            _crumb(hi, 16), _crumb(hi, 18)), (N, DW * 16))

    @triton.jit
    def _load_block(KPW, KS, KM, VPW, VS, VM, kp0, ks0, vs0, n0, stop, s_pt, s_kg, s_vt,
                    BITS: tl.constexpr, G: tl.constexpr, VG: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr):
        """Words, scales and mins of tokens n0 .. n0 + BLOCK_N - 1 of the store (those below
        stop; n0 and stop multiples of G)."""
        DW: tl.constexpr = D * BITS // 32
        NG: tl.constexpr = BLOCK_N // G
        NVG: tl.constexpr = D // VG
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        rows = (offs_n.to(tl.int64) * s_pt)[:, None] + tl.arange(0, DW)[None, :]
        kw = tl.load(KPW + kp0 + rows, mask=n_ok[:, None], other=0)
        vw = tl.load(VPW + kp0 + rows, mask=n_ok[:, None], other=0)
        grp = n0 // G + tl.arange(0, NG)
        g_ok = grp * G < stop
        kofs = ks0 + grp[:, None].to(tl.int64) * s_kg + tl.arange(0, D)[None, :]
        ksc = tl.load(KS + kofs, mask=g_ok[:, None], other=0.0)
        kmn = tl.load(KM + kofs, mask=g_ok[:, None], other=0.0)
        vofs = vs0 + offs_n[:, None].to(tl.int64) * s_vt + tl.arange(0, NVG)[None, :]
        vsc = tl.load(VS + vofs, mask=n_ok[:, None], other=0.0)
        vmn = tl.load(VM + vofs, mask=n_ok[:, None], other=0.0)
        return kw, ksc, kmn, vw, vsc, vmn, n_ok

    @triton.jit
    def _block_softmax(q, kw, ksc, kmn, vw, vsc, vmn, n_ok, m_i, l_i, acc, scale, BITS: tl.constexpr,
                       G: tl.constexpr, VG: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                       IEEE: tl.constexpr):
        """A loaded block into the online softmax, dequantized as the reference does: code *
        scale + min in fp32, rounded to the cache's dtype."""
        NG: tl.constexpr = BLOCK_N // G
        NVG: tl.constexpr = D // VG
        kc = tl.reshape(_codes(kw, BITS), (NG, G, D))
        k = tl.reshape(kc * ksc.to(tl.float32)[:, None, :] + kmn.to(tl.float32)[:, None, :], (BLOCK_N, D))
        vc = tl.reshape(_codes(vw, BITS), (BLOCK_N, NVG, VG))
        v = tl.reshape(vc * vsc.to(tl.float32)[:, :, None] + vmn.to(tl.float32)[:, :, None], (BLOCK_N, D))
        k = k.to(ksc.dtype).to(q.dtype)
        v = v.to(vsc.dtype).to(q.dtype)
        return _softmax_block(q, k, v, n_ok, m_i, l_i, acc, scale, IEEE)

    @triton.jit
    def _quantized_tokens(q, KPW, KS, KM, VPW, VS, VM, kp0, ks0, vs0, start, stop, s_pt, s_kg, s_vt,
                          m_i, l_i, acc, scale, BITS: tl.constexpr, G: tl.constexpr, VG: tl.constexpr,
                          D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                          PREFETCH: tl.constexpr):
        """Tokens start .. stop - 1 of the store into the online softmax, BLOCK_N at a time.
        PREFETCH: the next block is loaded before the current one is computed (twice the bytes
        in flight per program; the loads feed no dot directly, so Triton's pipeliner leaves
        them alone)."""
        if PREFETCH:
            cur = _load_block(KPW, KS, KM, VPW, VS, VM, kp0, ks0, vs0, start, stop, s_pt, s_kg, s_vt,
                              BITS, G, VG, D, BLOCK_N)
            for n0 in range(start, stop, BLOCK_N):
                nxt = _load_block(KPW, KS, KM, VPW, VS, VM, kp0, ks0, vs0, n0 + BLOCK_N, stop, s_pt,
                                  s_kg, s_vt, BITS, G, VG, D, BLOCK_N)
                kw, ksc, kmn, vw, vsc, vmn, n_ok = cur
                m_i, l_i, acc = _block_softmax(q, kw, ksc, kmn, vw, vsc, vmn, n_ok, m_i, l_i, acc, scale,
                                               BITS, G, VG, D, BLOCK_N, IEEE)
                cur = nxt
        else:
            for n0 in range(start, stop, BLOCK_N):
                kw, ksc, kmn, vw, vsc, vmn, n_ok = _load_block(KPW, KS, KM, VPW, VS, VM, kp0, ks0, vs0,
                                                               n0, stop, s_pt, s_kg, s_vt, BITS, G, VG,
                                                               D, BLOCK_N)
                m_i, l_i, acc = _block_softmax(q, kw, ksc, kmn, vw, vsc, vmn, n_ok, m_i, l_i, acc, scale,
                                               BITS, G, VG, D, BLOCK_N, IEEE)
        return m_i, l_i, acc

    @triton.jit
    def _age_group(KP, KS, KM, VP, VS, VM, KR, VR, kp0, ks0, vs0, kr0, first, ring,
                   s_pt, s_kg, s_vt, s_rt, BITS: tl.constexpr, G: tl.constexpr, VG: tl.constexpr,
                   D: tl.constexpr):
        """Quantize tokens first .. first + G - 1 from the ring into the store (the layout of
        kivi.py's quantize kernels: keys per channel over the G tokens, values per token over
        VG channels; codes taken from the stored scale and min)."""
        PER: tl.constexpr = 8 // BITS
        QMAX: tl.constexpr = (1 << BITS) - 1
        DP: tl.constexpr = D // PER
        SDT: tl.constexpr = KS.dtype.element_ty
        t = first + tl.arange(0, G)
        slot = (t % ring).to(tl.int64) * s_rt
        # keys: (G, DP, PER), channel j * PER + i
        j3 = tl.arange(0, DP)[None, :, None]
        i3 = tl.arange(0, PER)[None, None, :]
        x = tl.load(KR + kr0 + slot[:, None, None] + j3 * PER + i3).to(tl.float32)
        sc, mn, inv = _scale_min(tl.min(x, axis=0), tl.max(x, axis=0), QMAX, SDT)
        ch = tl.arange(0, DP)[:, None] * PER + tl.arange(0, PER)[None, :]
        tl.store(KS + ks0 + (first // G) * s_kg + ch, sc)
        tl.store(KM + ks0 + (first // G) * s_kg + ch, mn)
        byte = _packed(x, mn[None], inv[None], i3 * BITS, 2, QMAX)
        prow = t[:, None].to(tl.int64) * s_pt
        tl.store(KP + kp0 + prow + tl.arange(0, DP)[None, :], byte)
        # values: (G, NVG, GP, PER), channel (g * GP + j) * PER + i
        NVG: tl.constexpr = D // VG
        GP: tl.constexpr = VG // PER
        g4 = tl.arange(0, NVG)[None, :, None, None]
        j4 = tl.arange(0, GP)[None, None, :, None]
        i4 = tl.arange(0, PER)[None, None, None, :]
        x4 = tl.load(VR + kr0 + slot[:, None, None, None] + (g4 * GP + j4) * PER + i4).to(tl.float32)
        vsc, vmn, vinv = _scale_min(tl.min(tl.min(x4, axis=3), axis=2), tl.max(tl.max(x4, axis=3), axis=2),
                                    QMAX, SDT)  # (G, NVG)
        vofs = vs0 + t[:, None].to(tl.int64) * s_vt + tl.arange(0, NVG)[None, :]
        tl.store(VS + vofs, vsc)
        tl.store(VM + vofs, vmn)
        vbyte = _packed(x4, vmn[:, :, None, None], vinv[:, :, None, None], i4 * BITS, 3, QMAX)  # (G, NVG, GP)
        b3 = tl.arange(0, NVG)[None, :, None] * GP + tl.arange(0, GP)[None, None, :]
        tl.store(VP + kp0 + prow[:, :, None] + b3, vbyte)

    @triton.jit
    def _static_kivi_kernel(Q, K, V, KP, KPW, KS, KM, VP, VPW, VS, VM, KR, VR, POS, MID_O, MID_LSE,
                            scale, split_len, ring, n_splits,
                            sq_b, sq_h, sk_b, sk_h, sv_b, sv_h,
                            sp_b, sp_h, sp_t, sw_b, sw_h, sw_t, sks_b, sks_h, sks_g,
                            svs_b, svs_h, svs_t, sr_b, sr_h, sr_t,
                            smo_s, smo_h, smo_p, sml_s, sml_h,
                            BITS: tl.constexpr, G: tl.constexpr, VG: tl.constexpr, R: tl.constexpr,
                            GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_R: tl.constexpr,
                            IEEE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        if PDL:  # launched early behind the kernel that makes q, k, v: wait for it
            _tl_cuda.gdc_wait()
        P = tl.load(POS).to(tl.int32)
        nq0 = G * (tl.maximum(P - R, 0) // G)      # quantized before this token
        nq = G * (tl.maximum(P + 1 - R, 0) // G)   # ... and after it
        q, heads, offs_d, g_ok, d_ok = _group_queries(Q + b * sq_b, kvh, sq_h, GROUP, BLOCK_G, D, D)
        m_i, l_i, acc = _softmax_init(BLOCK_G, D)
        kp0 = b * sw_b + kvh * sw_h
        ks0 = b * sks_b + kvh * sks_h
        vs0 = b * svs_b + kvh * svs_h
        kr0 = b * sr_b + kvh * sr_h
        if sp < n_splits:  # a split of the groups quantized before this step
            start = sp * split_len
            stop = tl.minimum(start + split_len, nq0)
            m_i, l_i, acc = _quantized_tokens(q, KPW, KS, KM, VPW, VS, VM, kp0, ks0, vs0, start, stop,
                                              sw_t, sks_g, svs_t, m_i, l_i, acc, scale,
                                              BITS, G, VG, D, BLOCK_N, IEEE, PREFETCH)
        else:  # the new token, a group that ages with it, and the full-precision tokens
            kn = tl.load(K + b * sk_b + kvh * sk_h + offs_d)
            vn = tl.load(V + b * sv_b + kvh * sv_h + offs_d)
            slot = kr0 + (P % ring).to(tl.int64) * sr_t + offs_d
            tl.store(KR + slot, kn.to(KR.dtype.element_ty))
            tl.store(VR + slot, vn.to(VR.dtype.element_ty))
            tl.debug_barrier()  # the ring rows below are read by other threads of this program
            if nq > nq0:
                p0 = b * sp_b + kvh * sp_h
                _age_group(KP, KS, KM, VP, VS, VM, KR, VR, p0, ks0, vs0, kr0, nq0, ring,
                           sp_t, sks_g, svs_t, sr_t, BITS, G, VG, D)
                tl.debug_barrier()
                m_i, l_i, acc = _quantized_tokens(q, KPW, KS, KM, VPW, VS, VM, kp0, ks0, vs0, nq0, nq,
                                                  sw_t, sks_g, svs_t, m_i, l_i, acc, scale,
                                                  BITS, G, VG, D, BLOCK_A, IEEE, False)
            for n0 in range(nq, P + 1, BLOCK_R):
                offs_n = n0 + tl.arange(0, BLOCK_R)
                n_ok = offs_n <= P
                ptr = kr0 + (offs_n % ring)[:, None].to(tl.int64) * sr_t + offs_d[None, :]
                k = tl.load(KR + ptr, mask=n_ok[:, None], other=0.0).to(q.dtype)
                v = tl.load(VR + ptr, mask=n_ok[:, None], other=0.0).to(q.dtype)
                m_i, l_i, acc = _softmax_block(q, k, v, n_ok, m_i, l_i, acc, scale, IEEE)
        if PDL:  # the merge launches only now (with the trigger at the start, its 2,048 programs
            # waited on the SMs: 268 against 260 us per layer at batch 64 and 4k slots)
            _tl_cuda.gdc_launch_dependents()
        acc, lse = _softmax_result(acc, l_i, m_i)
        tl.store(MID_O + b * smo_s + heads[:, None] * smo_h + sp * smo_p + offs_d[None, :], acc,
                 mask=g_ok[:, None])
        tl.store(MID_LSE + b * sml_s + heads * sml_h + sp, lse, mask=g_ok)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def triton_supports(head_dim: int, spec: dict) -> bool:
    """Whether the Triton kernel takes a layer of this head_dim and KIVI spec."""
    return (_pow2(head_dim) and head_dim >= 16 and _pow2(spec["group"]) and _pow2(spec["value_group"])
            and head_dim * spec["bits"] % 32 == 0)


def static_kivi_triton(q, k, v, kp, ks, km, vp, vs, vm, kr, vr, pos, *, scale: float, bits: int,
                       group: int, value_group: int, residual: int, block_n: int = 128,
                       num_splits: int | None = None, programs_per_sm: int = 4,
                       num_warps: int = 4, prefetch: bool = True) -> torch.Tensor:
    B, H, D = q.shape
    Hkv, Sq = kp.shape[1], kp.shape[2]
    want = cache_shapes(B, Hkv, D, Sq + group - 1, _spec(bits, group, value_group, residual))
    got = dict(zip(CACHE_NAMES, (kp, ks, km, vp, vs, vm, kr, vr)))
    if H % Hkv or k.shape != (B, Hkv, D) or v.shape != k.shape or \
            any(tuple(got[n].shape) != want[n] for n in CACHE_NAMES):
        raise ValueError(f"static KIVI attention: q {tuple(q.shape)}, k {tuple(k.shape)} and the "
                         f"cache ({', '.join(f'{n} {tuple(t.shape)}' for n, t in got.items())}) disagree")
    if not triton_supports(D, _spec(bits, group, value_group, residual)):
        raise ValueError(f"static KIVI attention: the Triton path needs power-of-two head_dim >= 16 "
                         f"(got {D}) and groups (got {group}, {value_group})")
    if not all(t.is_contiguous() for t in got.values()):
        raise ValueError("static KIVI attention: the cache buffers must be contiguous")
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)  # views of the projection read in place
    block_n = max(block_n, group)
    # splits of the store, none shorter than a block; 63 at most: the merge tile takes the ring's too
    n = num_splits or static_splits(B, Hkv, max(Sq, 1), min_len=block_n, cap=63,
                                    programs=programs_per_sm * (sm_count(q.device) if q.is_cuda else 132))
    split_len = cdiv(cdiv(max(Sq, 1), n), block_n) * block_n
    n = cdiv(max(Sq, 1), split_len)
    mid_o = torch.empty((B, H, n + 1, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((B, H, n + 1), dtype=torch.float32, device=q.device)
    kpw, vpw = kp.view(torch.int32), vp.view(torch.int32)
    pdl = pdl_enabled(q)
    extra = {"launch_pdl": True} if pdl else {}
    gq = H // Hkv
    _static_kivi_kernel[(B, Hkv, n + 1)](
        q, k, v, kp, kpw, ks, km, vp, vpw, vs, vm, kr, vr, pos, mid_o, mid_lse,
        scale, split_len, kr.shape[2], n,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kp.stride(0), kp.stride(1), kp.stride(2), kpw.stride(0), kpw.stride(1), kpw.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        kr.stride(0), kr.stride(1), kr.stride(2),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        BITS=bits, G=group, VG=value_group, R=residual, GROUP=gq,
        BLOCK_G=max(16, triton.next_power_of_2(gq)), D=D, BLOCK_N=block_n,
        BLOCK_A=max(group, 16), BLOCK_R=32,  # the ageing group as one block: dots take 16+ rows
        IEEE=q.dtype == torch.float32, PDL=pdl, PREFETCH=prefetch, num_warps=num_warps,
        **extra)
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    _paged_decode_reduce_kernel[(B, H)](
        mid_o, mid_lse, out, n + 1, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        D=D, BLOCK_D=D, BLOCK_P=triton.next_power_of_2(n + 1), PDL=pdl, num_warps=1, **extra)
    return out


if not registered("static_kivi_decode"):
    @torch.library.custom_op("llmaccel::static_kivi_decode", mutates_args=CACHE_NAMES)
    def static_kivi_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kp: torch.Tensor,
                           ks: torch.Tensor, km: torch.Tensor, vp: torch.Tensor, vs: torch.Tensor,
                           vm: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, pos: torch.Tensor, *,
                           scale: float, bits: int, group: int, value_group: int,
                           residual: int) -> torch.Tensor:
        """Write k, v (B, Hkv, D) as token pos, age a group if due, attend q (B, H, D) over
        tokens 0 .. pos of the KIVI cache."""
        return static_kivi_decode_ref(q, k, v, kp, ks, km, vp, vs, vm, kr, vr, pos, scale=scale,
                                      bits=bits, group=group, value_group=value_group,
                                      residual=residual)

    @static_kivi_decode.register_fake
    def _(q, k, v, kp, ks, km, vp, vs, vm, kr, vr, pos, *, scale, bits, group, value_group, residual):
        return torch.empty_like(q)

    if triton is not None:
        @static_kivi_decode.register_kernel("cuda")
        def _(q, k, v, kp, ks, km, vp, vs, vm, kr, vr, pos, *, scale, bits, group, value_group, residual):
            return static_kivi_triton(q, k, v, kp, ks, km, vp, vs, vm, kr, vr, pos, scale=scale,
                                      bits=bits, group=group, value_group=value_group, residual=residual)
