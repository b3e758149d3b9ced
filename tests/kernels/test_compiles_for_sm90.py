"""Kernels compile for an H100/H200 (sm_90), checked on any machine with Triton's CUDA backend.

The interpreter (TRITON_INTERPRET=1, the CPU suite) runs kernels as Python and does not type
them: a kernel whose branches give one variable two dtypes runs there and fails to compile on a
GPU (the sampling kernel's one-program path did, so the engine fell back to sorted sampling on
vocabularies of up to 4,096 tokens). This test compiles, in a subprocess without the
interpreter, the variants the engine launches, for sm_90, with the ptxas Triton ships.
"""
import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmaccel.kernels import (bitlinear, bitlinear_gemv, gemv_a8, gemv_kernels, gemv_w8, gptq,
                              paged_attention, paged_rope, pointwise, sampling)

def sig(fn, types, consts):
    out = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    return ASTSource(fn=fn, signature=out, constexprs=consts)

P = {"x_ptr": "*fp32", "t_ptr": "*fp32", "k_ptr": "*i64", "p_ptr": "*fp32", "seed_ptr": "*i64",
     "pos_ptr": "*i64", "out_ptr": "*i64", "V": "i32", "sx": "i32", "R": "i32", "irow": "*i64",
     "frow": "*i64", "part": "*i64", "B": "i32", "S": "i32", "R0": "i32"}
cases = []
for dt in ("*fp32", "*bf16"):
    for greedy in (False, True):  # sample_triton / argmax_triton at a small vocabulary
        cases.append((f"sample {dt} greedy={greedy}", sampling._sample_kernel, {**P, "x_ptr": dt},
                      {"BLOCK": 1024, "GREEDY": greedy, "RESUME": False, "BLOCK_S": 2}))
    cases.append((f"sample resume {dt}", sampling._sample_kernel,
                  {**P, "x_ptr": dt, "irow": "*i32", "frow": "*fp32", "part": "*fp32"},
                  {"BLOCK": 1024, "GREEDY": False, "RESUME": True, "BLOCK_S": 64}))
    cases.append((f"rope {dt}", pointwise._rope_kernel,
                  dict(X=dt, C="*fp32", S="*fp32", P="*i64", O=dt, N="i32", T="i32", sxb="i32",
                       sxt="i32", spb="i32", spt="i32"),
                  {"H": 32, "HALF": 32, "BLOCK_H": 32, "BLOCK_D": 32, "ROWS": pointwise.ROWS}))
    cases.append((f"silu_mul {dt}", pointwise._silu_mul_kernel,
                  dict(G=dt, U=dt, O=dt, N="i32", I="i32", sg="i32", su="i32"),
                  {"BLOCK": 2048, "ROWS": pointwise.ROWS}))
cases.append(("gptq_block", gptq._gptq_block_kernel,
              dict(W="*fp32", H="*fp32", ST="*fp32", ZT="*fp32", Q="*fp32", E="*fp32", N="i32",
                   b="i32", s_w="i32", s_h="i32", s_q="i32", qmin="fp32", qmax="fp32"),
              {"BLOCK_R": gptq.BLOCK_R, "BLOCK_B": 128, "IEEE": True}))
for dt in ("*fp32", "*bf16"):
    for norm in (False, True):  # bitlinear / rms_norm_bitlinear at decode rows: dp4a, PDL
        cases.append((f"bitlinear_gemv {dt} norm={norm}", bitlinear_gemv._bitlinear_gemv_kernel,
                      dict(x_ptr=dt, g_ptr=dt, wp_ptr="*i32", ws_ptr=dt, b_ptr=dt, out_ptr=dt, N="i32",
                           K="i32", KW="i32", stride_xm="i32", stride_om="i32", eps="fp32"),
                      {"HAS_NORM": norm, "HAS_G": norm, "G_ROUND": norm, "HAS_BIAS": True, "IEEE": True,
                       "ASM": True, "PDL": True, "BLOCK_N": 8, "BLOCK_W": 128, "BLOCK_S": 1024}))
GV = dict(X="*bf16", W="*bf16", BIAS="*bf16", R="*bf16", O="*bf16", N_OUT="i32", K="i32", s_x="i32",
          s_w="i32", s_r="i32", s_o="i32", eps="fp32")
for one, persist in ((True, False), (False, False), (True, True)):  # the fused GEMVs, their forms
    for glu, norm in ((False, True), (True, True), (False, False)):
        cases.append((f"gemv one_chunk={one} persist={persist} glu={glu}", gemv_kernels._gemv_kernel, GV,
                      {"HAS_BIAS": False, "HAS_RES": not glu, "NORM": norm, "GLU": glu, "BLOCK_N": 8,
                       "BLOCK_K": 2048, "ONE_CHUNK": one, "PDL": True, "PERSIST": persist}))
        cases.append((f"gemv_int4 one_chunk={one} glu={glu}", gemv_kernels._gemv_int4_kernel,
                      dict(X="*bf16", W="*i32", S="*bf16", Z="*u8", BIAS="*bf16", R="*bf16", O="*bf16",
                           N_OUT="i32", K="i32", G="i32", ZB="i32", s_x="i32", s_r="i32", s_o="i32", eps="fp32"),
                      {"GS": 128, "HAS_BIAS": False, "HAS_RES": not glu, "NORM": norm, "GLU": glu,
                       "BLOCK_N": 4, "BLOCK_G": 16, "ONE_CHUNK": one, "PDL": True}))
for split, glu in ((1, True), (4, False)):  # gemv_int4 with int8 activations (dp4a), split-K
    cases.append((f"gemv_a8 split={split} glu={glu}", gemv_a8._gemv_a8_kernel,
                  dict(X="*bf16", W="*i32", S="*bf16", Z="*u8", BIAS="*bf16", R="*bf16", O="*bf16",
                       WS="*fp32", CNT="*i32", M="i32", N_OUT="i32", K="i32", G="i32", ZB="i32",
                       s_x="i32", s_r="i32", s_o="i32", eps="fp32"),
                  {"GS": 128, "HAS_BIAS": False, "HAS_RES": not glu, "NORM": glu, "GLU": glu,
                   "BLOCK_N": 32, "BLOCK_G": 16, "SPLIT": split, "PDL": True, "IEEE": True, "ASM": True}))
    cases.append((f"gemv_w8 split={split} glu={glu}", gemv_w8._gemv_w8_kernel,
                  dict(X="*bf16", W="*i32", S="*bf16", BIAS="*bf16", R="*bf16", O="*bf16", WS="*fp32",
                       CNT="*i32", M="i32", N_OUT="i32", K="i32", KW="i32", s_x="i32", s_r="i32",
                       s_o="i32", eps="fp32"),
                  {"HAS_BIAS": False, "HAS_RES": not glu, "NORM": glu, "GLU": glu, "BLOCK_N": 32,
                   "BLOCK_G": 8, "SPLIT": split, "PDL": True, "IEEE": True, "ASM": True}))
RP = {n: "i32" for n in ("sq_b sq_h sk_b sk_h sv_b sv_h sc_blk sc_s sc_h sbt s_cos so_b so_h smo_s smo_h "
                         "smo_p sml_s sml_h").split()}
RP.update(Q="*bf16", K="*bf16", V="*bf16", KC="*bf16", VC="*bf16", KS="*bf16", VS="*bf16", POS="*i64",
          BT="*i32", O="*bf16", MID_O="*fp32", MID_LSE="*fp32", COS="*fp32", SIN="*fp32", scale="fp32")
I8 = dict(KC="*i8", VC="*i8", KS="*fp16", VS="*fp16")  # the int8 cache (kvquant.bits=8)
for split, peel, quant in ((False, True, False), (True, False, False), (False, True, True), (True, False, True)):
    # paged decode attention with RoPE and the KV write
    cases.append((f"paged_rope split={split} peel={peel} int8={quant}", paged_rope._paged_rope_decode_kernel,
                  {**RP, **(I8 if quant else {})},
                  {"GROUP": 3, "BLOCK_G": 4, "BS": 16, "D": 64, "BLOCK_D": 64, "BLOCK_N": 64,
                   "SPLIT": split, "IEEE": False, "PEEL": peel, "PDL": peel, "QUANT": quant}))
PA = {n: "i32" for n in "sq_n sq_h so_n so_h sk_b sk_s sk_h sbt smo_s smo_h smo_p sml_s sml_h split_len".split()}
PA.update(Q="*bf16", KC="*bf16", VC="*bf16", KS="*bf16", VS="*bf16", O="*bf16", BT="*i32", CU="*i32",
          LENS="*i32", MID_O="*fp32", MID_LSE="*fp32", scale="fp32")
for quant in (False, True):  # paged attention of eager steps and graphs without folded RoPE
    types = {**PA, **(I8 if quant else {})}
    cases.append((f"paged_prefill int8={quant}", paged_attention._paged_prefill_kernel, types,
                  {"GROUP": 4, "BS": 16, "D": 64, "BLOCK_D": 64, "BLOCK_M": 64, "BLOCK_N": 64, "IEEE": False,
                   "QUANT": quant}))
    cases.append((f"paged_decode int8={quant}", paged_attention._paged_decode_kernel, types,
                  {"GROUP": 4, "BLOCK_G": 16, "BS": 16, "D": 64, "BLOCK_D": 64, "BLOCK_N": 64, "IEEE": False,
                   "QUANT": quant}))
for norm in (False, True):   # the ternary tensor-core kernel
    cases.append((f"bitlinear norm={norm}", bitlinear._bitlinear_kernel,
                  dict(x_ptr="*bf16", g_ptr="*bf16", wp_ptr="*u8", ws_ptr="*bf16", b_ptr="*bf16",
                       out_ptr="*fp32", M="i32", N="i32", K="i32", KB="i32", K_PER="i32", stride_xm="i32",
                       eps="fp32"),
                  {"HAS_NORM": norm, "HAS_G": norm, "G_ROUND": norm, "HAS_BIAS": True, "ATOMIC": True,
                   "IEEE": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_S": 256}))
target = GPUTarget("cuda", 90, 32)
failed = {}
for name, fn, types, consts in cases:
    try:
        triton.compile(sig(fn, types, consts), target=target,
                       options={"enable_fp_fusion": False} if "sample" not in name else None)
    except Exception as e:  # noqa: BLE001 - reported by the test
        failed[name] = f"{type(e).__name__}: {e}"[:2000]
print(json.dumps({"n": len(cases), "failed": failed}))
"""


def test_engine_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no CUDA backend")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=240, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    if res.returncode and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas for Triton's CUDA backend")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["n"] >= 10 and not out["failed"], out["failed"]
