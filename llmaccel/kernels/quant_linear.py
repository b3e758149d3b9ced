"""Triton kernels for linear_int4 (weights dequantized in registers); linear_int8 in
quant_linear_int8.py, the building blocks both use in int_codes.py.

Decode (M <= 16 rows) is bound by the weight bytes, so the GEMV kernels are built to stream them:
  * weights are read as int32 words (8 int4 codes or 4 int8 codes per load, 16-byte vectors per
    thread), coalesced: a row's bytes are contiguous in the MatMulNBits layout;
  * codes become fp32 without an int->float conversion instruction (those issue at 1/8 of the
    FMA rate on Hopper and would cap the kernel near half the bandwidth): the masked code is
    ORed, in place, into the mantissa of 2^23 and one exact FMA removes the magic and the
    in-place shift. 8 codes per word, then tl.join + reshape restores column order (or, with
    UNPACK=1, the matching x columns are read with a stride of 8 instead);
  * int4 scales and zero points are applied once per (row, group), not per weight:
    y += s * (sum_k q x - z * sum_k x);
  * one launch writes the output in x's dtype with the bias (no memset, no cast kernel), unless
    SPLIT_K > 1, where fp32 partials are added atomically (only for few rows and long K);
  * every program processes all M rows for its weight tile, so weights are read once per step.
A second int4 kernel dequantizes tiles to x's dtype and uses tl.dot (M padded to 16): the prefill
path, and an option for decode batches where the FMA count of the GEMV grows with M.
Tile choices: quant_linear_configs.py (`TUNED`, measured on the H200 by
`scripts/gpu_quant_bench.py`, else a heuristic). No autotuning at call time (it would also run
under the CPU interpreter).

Registered as the torch.library custom op llmaccel::linear_int4 (llmaccel::linear_int8: in
quant_linear_int8.py): the CPU (and any non-CUDA) implementation is the reference in
llmaccel/ops/quant.py, CUDA runs Triton.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from llmaccel.kernels import cdiv, device_index, device_name, registered, sm_count
from llmaccel.kernels.int_codes import cpu_act_dtype, finish, out_buffer, packed_words, rows_of
from llmaccel.kernels.quant_linear_configs import (  # noqa: F401  (re-exported)
    GEMV_MAX_M, TUNED, _pow2, batch_bucket, int4_config, int8_config)
from llmaccel.ops import quant as ref

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference paths work without triton
    triton = None

if triton is not None:  # int_codes defines its jit building blocks only with triton
    from llmaccel.kernels.int_codes import (epilogue, epilogue_serial, int4_tile, int4_words,
                                            interleave8, x8)


if triton is not None:
    @triton.jit
    def _int4_gemv_step(acc, acc3, g0, x_ptr, w_ptr, s_ptr, z_ptr, K, G, ZB, stride_xm, rn, n_ok,
                        rg, rc, rm, GS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_G: tl.constexpr, EVEN_K: tl.constexpr, UNPACK: tl.constexpr):
        """One K step of _int4_gemv_kernel: groups g0 .. g0 + BLOCK_G of rows rn."""
        g = g0 + rg
        g_ok = g < G
        w, s, z = int4_tile(w_ptr, s_ptr, z_ptr, rn, n_ok, g, g_ok, G, ZB, GS)
        if UNPACK == 2:
            n0, n1, n2, n3, n4, n5, n6, n7 = int4_words(w, z[:, :, None])
        else:
            n0, n1, n2, n3, n4, n5, n6, n7 = int4_words(w, 0.0)
        if UNPACK == 0:
            q = tl.reshape(interleave8(n0, n1, n2, n3, n4, n5, n6, n7), (BLOCK_N, BLOCK_G, GS))
        for m in tl.static_range(ROWS):
            if UNPACK == 0:
                xk = g[:, None] * GS + rc[None, :]
                if EVEN_K:
                    xm = g_ok[:, None]
                else:
                    xm = g_ok[:, None] & (xk < K)
                xv = tl.load(x_ptr + m * stride_xm + xk, mask=xm, other=0.0).to(tl.float32)
                d = tl.sum(q * xv[None, :, :], axis=2)
                xs = tl.sum(xv, axis=1)
            else:  # x columns 8j + i read with stride 8 next to nibble i of word j
                x0, x1, x2, x3, x4, x5, x6, x7 = x8(x_ptr + m * stride_xm, g, g_ok, K, GS)
                t = n0 * x0[None] + n1 * x1[None] + n2 * x2[None] + n3 * x3[None] \
                    + n4 * x4[None] + n5 * x5[None] + n6 * x6[None] + n7 * x7[None]
                if UNPACK == 1:
                    d = tl.sum(t, axis=2)
                    xs = tl.sum(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), axis=1)
            if UNPACK == 2:
                acc3 += s[:, :, None] * t
            else:
                part = tl.sum(s * (d - z * xs[None, :]), axis=1)
                if ROWS == 1:
                    acc += part[None, :]
                else:
                    acc = tl.where(rm[:, None] == m, acc + part[None, :], acc)
        return acc, acc3

    @triton.jit
    def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, G, ZB,
                          GPS, stride_xm, GS: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, EVEN_K: tl.constexpr,
                          UNPACK: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                          STAGES: tl.constexpr = 1, SERIAL: tl.constexpr = False):
        """STAGES > 1 pipelines the weight loads of the K loop (cp.async into shared memory,
        STAGES - 1 tiles in flight ahead of the math): a long K loop per program then keeps
        enough bytes in flight without more programs. UNPACK=2 (one row only): the zero point
        is folded into the magic FMA (codes come out as q - z) and the partial sums stay
        elementwise in registers, reduced across threads once after the loop instead of in every
        step (no x sums either; x still reaches the weights' layout through shared memory)."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rg = tl.arange(0, BLOCK_G)
        rc = tl.arange(0, GS)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_G, GS // 8), dtype=tl.float32)
        g_lo = pid_k * GPS
        if STAGES > 1:
            for g0 in tl.range(g_lo, g_lo + GPS, BLOCK_G, num_stages=STAGES):
                acc, acc3 = _int4_gemv_step(acc, acc3, g0, x_ptr, w_ptr, s_ptr, z_ptr, K, G, ZB,
                                            stride_xm, rn, n_ok, rg, rc, rm, GS, ROWS, BLOCK_N,
                                            BLOCK_G, EVEN_K, UNPACK)
        else:
            for g0 in range(g_lo, g_lo + GPS, BLOCK_G):
                acc, acc3 = _int4_gemv_step(acc, acc3, g0, x_ptr, w_ptr, s_ptr, z_ptr, K, G, ZB,
                                            stride_xm, rn, n_ok, rg, rc, rm, GS, ROWS, BLOCK_N,
                                            BLOCK_G, EVEN_K, UNPACK)
        if UNPACK == 2:
            acc += tl.sum(tl.sum(acc3, axis=2), axis=1)[None, :]
        if SERIAL:
            epilogue_serial(acc, ws_ptr, cnt_ptr, b_ptr, out_ptr, rm, rn, ROWS, N, pid_n, pid_k,
                             tl.num_programs(1), HAS_BIAS)
        else:
            epilogue(acc, b_ptr, out_ptr, rm, rn, ROWS, N, HAS_BIAS, ATOMIC)

    @triton.jit
    def _int4_dot_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, G, ZB, GPS, stride_xm,
                         GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_G: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                         HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        rg = tl.arange(0, BLOCK_G)
        rk = tl.arange(0, BLOCK_G * GS)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        g_lo = pid_k * GPS
        for g0 in range(g_lo, g_lo + GPS, BLOCK_G):
            g = g0 + rg
            g_ok = g < G
            w, s, z = int4_tile(w_ptr, s_ptr, z_ptr, rn, n_ok, g, g_ok, G, ZB, GS)
            n0, n1, n2, n3, n4, n5, n6, n7 = int4_words(w, 0.0)
            q = tl.reshape(interleave8(n0, n1, n2, n3, n4, n5, n6, n7), (BLOCK_N, BLOCK_G, GS))
            # rounded to x's dtype as the reference's dequantize_int4 does
            wd = tl.reshape(tl.fma(q, s[:, :, None], -(z * s)[:, :, None]), (BLOCK_N, BLOCK_G * GS))
            k = g0 * GS + rk
            km = (k < G * GS) if EVEN_K else (k < K)
            xv = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & km[None, :],
                         other=0.0)
            wd = wd.to(xv.dtype)
            if IEEE:  # fp32 inputs: no silent tf32
                acc += tl.dot(xv, tl.trans(wd), input_precision="ieee")
            else:
                acc += tl.dot(xv, tl.trans(wd))
        epilogue(acc, b_ptr, out_ptr, rm, rn, M, N, HAS_BIAS, ATOMIC)

    @triton.jit
    def _int4_bf16_pairs(w, offz):
        """PTX: q - z for the 8 codes of each word as exact bf16 integers, two per LOP3 (the code
        ORed into the mantissa of 128.0) and one bf16x2 FMA adding offz = -(128 + z) twice.
        Output i is column 8j + i."""
        q = tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, t2, t3, u, k, m, one;
            mov.b32 k, 0x000F000F;
            mov.b32 m, 0x43004300;
            mov.b32 one, 0x3F803F80;
            lop3.b32 t0, $8, k, m, 0xEA;
            shr.u32 u, $8, 4;
            lop3.b32 t1, u, k, m, 0xEA;
            shr.u32 u, $8, 8;
            lop3.b32 t2, u, k, m, 0xEA;
            shr.u32 u, $8, 12;
            lop3.b32 t3, u, k, m, 0xEA;
            fma.rn.bf16x2 t0, t0, one, $9;
            fma.rn.bf16x2 t1, t1, one, $9;
            fma.rn.bf16x2 t2, t2, one, $9;
            fma.rn.bf16x2 t3, t3, one, $9;
            mov.b32 {$0, $4}, t0;
            mov.b32 {$1, $5}, t1;
            mov.b32 {$2, $6}, t2;
            mov.b32 {$3, $7}, t3;
            }""",
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, offz], dtype=(tl.int16,) * 8, is_pure=True, pack=1)
        return (q[0].to(tl.bfloat16, bitcast=True), q[1].to(tl.bfloat16, bitcast=True),
                q[2].to(tl.bfloat16, bitcast=True), q[3].to(tl.bfloat16, bitcast=True),
                q[4].to(tl.bfloat16, bitcast=True), q[5].to(tl.bfloat16, bitcast=True),
                q[6].to(tl.bfloat16, bitcast=True), q[7].to(tl.bfloat16, bitcast=True))

    @triton.jit
    def _int4_dot_asm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                             G, ZB, GPS, stride_xm, GS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                             ATOMIC: tl.constexpr, PREFETCH: tl.constexpr = False,
                             XPERM: tl.constexpr = False, SERIAL: tl.constexpr = False):
        """bf16 x only (CUDA): q - z dequantized two codes per instruction (exact in bf16), tensor
        cores multiply them by x, one group per dot, and the scale multiplies the [M, N] group
        sums: y += s * dot(x, q - z). The dot's K order inside each word is the registers' order
        [0, 4, 1, 5, 2, 6, 3, 7]; x is read in the same order."""
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        rw = tl.arange(0, GS // 8)
        rk = tl.arange(0, GS)
        kperm = (rk // 8) * 8 + (rk % 8) // 2 + 4 * (rk % 2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        g_lo = pid_k * GPS
        g_hi = tl.minimum(g_lo + GPS, G)
        w_row = w_ptr + rn[:, None] * (G * (GS // 8)) + rw[None, :]
        # PREFETCH: the next group's words are loaded before this group's math, twice the bytes
        # in flight (the loads feed inline PTX, which Triton's pipeliner does not stage), at the
        # cost of registers (fewer programs per SM) and address math
        if PREFETCH:
            w = tl.load(w_row + g_lo * (GS // 8), mask=n_ok[:, None] & (g_lo < g_hi), other=0)
        for g in range(g_lo, g_hi):
            if PREFETCH:
                w_cur = w
                w = tl.load(w_row + (g + 1) * (GS // 8), mask=n_ok[:, None] & (g + 1 < g_hi), other=0)
            else:
                w_cur = tl.load(w_row + g * (GS // 8), mask=n_ok[:, None], other=0)
            s = tl.load(s_ptr + rn * G + g, mask=n_ok, other=0.0).to(tl.float32)
            zb = tl.load(z_ptr + rn * ZB + g // 2, mask=n_ok, other=0).to(tl.int32)
            z = (zb >> ((g % 2) * 4)) & 0xF
            offz = (z | (z << 16)) | -1023360256  # bf16x2 (-(128 + z), -(128 + z)): 0xC300C300 | z
            offz = tl.broadcast_to(offz[:, None], w_cur.shape)
            q0, q1, q2, q3, q4, q5, q6, q7 = _int4_bf16_pairs(w_cur, offz)
            q = tl.reshape(tl.join(tl.join(tl.join(q0, q2), tl.join(q1, q3)),
                                   tl.join(tl.join(q4, q6), tl.join(q5, q7))), (BLOCK_N, GS))
            # XPERM: x is loaded in column order (16-byte vectors) and permuted in registers /
            # shared memory instead of gathered element by element
            k = g * GS + (rk if XPERM else kperm)
            km = (k < G * GS) if EVEN_K else (k < K)
            xv = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & km[None, :],
                         other=0.0)
            if XPERM:  # [.., 8j + 4a + b] -> [.., 8j + 2b + a]: the order kperm gathers
                xv = tl.reshape(tl.permute(tl.reshape(xv, (BLOCK_M, GS // 8, 2, 4)), (0, 1, 3, 2)),
                                (BLOCK_M, GS))
            acc += s[None, :] * tl.dot(xv, tl.trans(q))
        if SERIAL:
            epilogue_serial(acc, ws_ptr, cnt_ptr, b_ptr, out_ptr, rm, rn, M, N,
                             pid_m * tl.num_programs(1) + pid_n, pid_k, tl.num_programs(2), HAS_BIAS)
        else:
            epilogue(acc, b_ptr, out_ptr, rm, rn, M, N, HAS_BIAS, ATOMIC)

# --- launch configuration: tables and heuristics in quant_linear_configs.py ------------------------

def _probe_matches(dev: torch.device, dtype: torch.dtype, cfg: dict) -> bool:
    """One small linear_int4 launch with `cfg` against the reference: 2 rows, 64 outputs, 2 groups
    of 128 in the stored layout (packed codes, scales, packed zero points); 2e-2 of the scale."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, generator=g).to(dev, dtype)
    qw = ref.pack_int4(torch.randint(0, 16, (64, 2, 128), generator=g)).to(dev)
    sc = (torch.rand(64, 2, generator=g) * 0.01 + 0.001).to(dev, dtype)
    zr = ref.pack_zeros(torch.randint(0, 16, (64, 2), generator=g)).to(dev)
    out = _linear_int4_launch(x, x, 2, 64, 256, 2, qw, sc, zr, None, 128, cfg)
    want = ref.linear_int4(x.float(), qw, sc.float(), zr, group_size=128)
    return bool(torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max())))


@functools.cache
def _asm_works(index: int) -> bool:
    """Whether this device's Triton and driver take the PTX-dequantizing int4 kernel: one small
    launch checked against the reference, once per device; where not, a warning and the
    pure-Triton kernels."""
    cfg = dict(kernel="dotasm", BLOCK_M=16, BLOCK_N=64, BLOCK_G=1, SPLIT_K=1, num_warps=2, num_stages=3)
    try:
        ok = _probe_matches(torch.device("cuda", index), torch.bfloat16, cfg)
        why = "" if ok else "its output differs from the reference"
    except Exception as e:  # noqa: BLE001 - PTX this Triton or driver refuses
        ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    if not ok:
        warnings.warn(f"int4 linears on {torch.cuda.get_device_name(index)} use the pure-Triton "
                      f"kernels: the PTX-dequantizing kernel failed its check ({why})")
    return ok


# --- wrappers ------------------------------------------------------------------------------------

def linear_int4_triton(x, qweight, scales, zeros, bias=None, *, group_size: int, config=None):
    """Triton linear_int4; `config` overrides the tile choice (benchmarks, tests)."""
    N, G, half = qweight.shape
    K = x.shape[-1]
    if 2 * half != group_size or group_size % 8 or K > G * group_size or scales.shape != (N, G):
        raise ValueError(f"linear_int4: qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)}, "
                         f"group_size {group_size} and in_features {K} disagree")
    x2 = rows_of(x, K)
    M = x2.shape[0]
    if M == 0:
        return ref.linear_int4(x, qweight, scales, zeros, bias, group_size=group_size)
    asm = x.dtype == torch.bfloat16 and x.is_cuda and _asm_works(device_index(x.device))
    cfg = dict(config) if config is not None else \
        int4_config(M, N, K, group_size, sm_count(x.device), asm=asm, device=device_name(x.device))
    return _linear_int4_launch(x, x2, M, N, K, G, qweight, scales, zeros, bias, group_size, cfg)


def _linear_int4_launch(x, x2, M, N, K, G, qweight, scales, zeros, bias, group_size, cfg):
    cfg = dict(cfg)
    kernel = cfg.pop("kernel", "gemv")
    if kernel == "gemv" and M > GEMV_MAX_M:
        raise ValueError(f"linear_int4: the GEMV kernel takes at most {GEMV_MAX_M} rows, got {M}")
    split = cfg.pop("SPLIT_K", 1)
    gps = cdiv(cdiv(G, split), cfg["BLOCK_G"]) * cfg["BLOCK_G"]  # groups per split
    split = cdiv(G, gps)
    serial = cfg.pop("SERIAL", False) and split > 1 and kernel in ("gemv", "dotasm")
    tiles = cdiv(N, cfg["BLOCK_N"]) * (1 if kernel == "gemv" else cdiv(M, cfg["BLOCK_M"]))
    ws = split_workspace(x.device, split * M * N, tiles) if serial else None
    serial = ws is not None
    out = out_buffer(M, N, x, 1 if serial else split)
    has_bias = bias is not None and (split == 1 or serial)
    args = (x2, packed_words(qweight), scales.contiguous(), zeros.contiguous(), bias if has_bias else out, out)
    flags = dict(GS=group_size, EVEN_K=K == G * group_size, HAS_BIAS=has_bias,
                 ATOMIC=split > 1 and not serial)
    if serial:
        flags["SERIAL"] = True
    ws = ws or (out, out)
    if kernel == "gemv":
        if M > 1 and cfg.get("UNPACK") == 2:  # elementwise accumulators hold one row
            cfg["UNPACK"] = 1
        grid = (cdiv(N, cfg["BLOCK_N"]), split)
        _int4_gemv_kernel[grid](*args, *ws, N, K, G, zeros.shape[1], gps, x2.stride(0), ROWS=M,
                                BLOCK_M=_pow2(M), **flags, **cfg)
    elif kernel == "dotasm":  # bf16 on CUDA only: inline PTX
        if x.dtype != torch.bfloat16 or not x.is_cuda:
            raise ValueError("linear_int4: the dotasm kernel takes bf16 CUDA inputs")
        cfg.pop("UNPACK", None)
        cfg.pop("BLOCK_G", None)
        grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"]), split)
        _int4_dot_asm_kernel[grid](*args, *ws, M, N, K, G, zeros.shape[1], gps, x2.stride(0), **flags,
                                   **cfg)
    else:
        cfg.pop("UNPACK", None)
        grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"]), split)
        _int4_dot_kernel[grid](*args, M, N, K, G, zeros.shape[1], gps, x2.stride(0),
                               IEEE=x.dtype == torch.float32, **flags, **cfg)
    return finish(out, x, bias, 1 if serial else split)


_WORKSPACES: dict = {}


def split_workspace(device, n_partial: int, n_tiles: int):
    """fp32 partials and zeroed tile counters for one-launch split-K, kept per (device, sizes):
    the kernel leaves the counters at zero, so a buffer is reused by every later call, also by
    CUDA graph replays (calls on one stream; concurrent streams would share the counters). None
    while a graph is being captured and the buffer does not exist yet (the caller then takes the
    memset + atomics path)."""
    key = (str(device), n_partial, n_tiles)
    hit = _WORKSPACES.get(key)
    if hit is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        hit = (torch.empty(n_partial, device=device, dtype=torch.float32),
               torch.zeros(n_tiles, device=device, dtype=torch.int32))
        _WORKSPACES[key] = hit
    return hit


# --- custom ops: CPU = reference, CUDA = Triton ---------------------------------------------------


def _linear_int4_cuda(x, qweight, scales, zeros, bias=None, group_size=128):
    if triton is None:
        return ref.linear_int4(x, qweight, scales, zeros, bias, group_size=group_size)
    return linear_int4_triton(x, qweight, scales, zeros, bias, group_size=group_size)


if not registered("linear_int4"):
    @torch.library.custom_op("llmaccel::linear_int4", mutates_args=())
    def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, group_size: int = 128) -> torch.Tensor:
        return ref.linear_int4(x, qweight, scales, zeros, bias, group_size=group_size)

    linear_int4.register_kernel("cuda")(_linear_int4_cuda)

    @linear_int4.register_fake
    def _linear_int4_fake(x, qweight, scales, zeros, bias=None, group_size=128):
        return x.new_empty(*x.shape[:-1], qweight.shape[0])

def prepare_int4_cpu(qweight, scales, zeros, group_size: int):
    """(packed, scales_and_zeros) for aten's CPU int4 GEMM, or None where it does not apply.

    aten computes w = (q - 8) * scale + zero_f with a float zero: ours is (q - z) * scale,
    so zero_f = (8 - z) * scale. Its packing wants N a multiple of 16 and a group size of
    32-256; K is the stored, group-padded width (x is zero-padded to it).
    """
    N, G, _ = qweight.shape
    if N % 16 or group_size not in (32, 64, 128, 256) or not scales.is_floating_point():
        return None
    q = ref.unpack_int4(qweight).reshape(N, G * group_size).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    z = ref.unpack_int4(zeros)[:, :G].float()
    s = scales.float()
    # in the dtype the GEMM runs in, converted here once: a conversion inside a compiled step
    # would be a pointwise node, which Inductor's lowering of the aten op does not take
    sz = torch.stack([s.T, ((8 - z) * s).T], -1).to(cpu_act_dtype(scales.dtype)).contiguous()
    return packed, sz


def linear_int4_cpu(x, packed, scales_and_zeros, bias=None, *, group_size: int):
    """x @ W.T (+ bias) with W held as prepare_int4_cpu's output; aten's CPU int4 GEMM, in
    cpu_act_dtype(x), the output in x's dtype."""
    kp = 2 * packed.shape[1]
    dt = cpu_act_dtype(x.dtype)
    x2 = x.reshape(-1, x.shape[-1]).to(dt)
    if x2.shape[-1] != kp:
        x2 = torch.nn.functional.pad(x2, (0, kp - x2.shape[-1]))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), packed, group_size,
                                                   scales_and_zeros.to(dt)).to(x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], packed.shape[0])


# The lowering calls these forms directly on the CPU (traced into the compiled step; see
# llmaccel/codegen/lower.py), not through the custom ops: {op: (prepare, fn, n)}, where prepare
# converts the op's n stored weights once, at lowering, into what fn reads.
CPU_FORMS = {"linear_int4": (prepare_int4_cpu, linear_int4_cpu, 3)}
