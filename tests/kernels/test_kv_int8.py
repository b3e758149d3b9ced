"""The int8 KV cache (kvquant.bits=8): row quantization, the paged ops' references on an int8
cache against attention over the dequantized cache, and the Triton kernels against the
references (interpreter on the CPU at small shapes; -m cuda at real shapes in bf16).

Tolerances: quantization error at most half a step (s / 2 per row) plus fp32 rounding; kernels
as test_paged_attention.py (fp32 2e-5, fp16 2e-3, bf16 2e-2); codes written by a kernel may
differ from the reference's by one step where a product rounds across a half (Triton's fp32
division is not IEEE's), so the written rows are compared dequantized, within one step.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmaccel.kernels import paged_attention as pa  # noqa: E402
from llmaccel.kernels import paged_rope as pr  # noqa: E402
from llmaccel.ops.kv_int8 import dequantize_rows, quantize_rows  # noqa: E402
from tests.kernels.test_paged_attention import TOL, contiguous_ref, make_case  # noqa: E402
from tests.kernels.test_paged_rope import make_case as rope_case  # noqa: E402

needs_triton = pytest.mark.skipif(pa.triton is None, reason="triton not installed")


def to_int8(c, k="k_cache", v="v_cache"):
    """The case's caches as int8 codes with row scales: (kc, vc, ks, vs)."""
    kc, ks = quantize_rows(c[k])
    vc, vs = quantize_rows(c[v])
    return kc, vc, ks, vs


def test_rows_quantize_within_half_a_step():
    x = torch.randn(5, 7, 64) * torch.rand(5, 7, 1) * 30
    x[0, 0] = 0.0  # an all-zero row: scale 0, codes 0, exact
    codes, s = quantize_rows(x)
    assert codes.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (5, 7)
    assert int(codes.abs().max()) <= 127
    err = (dequantize_rows(codes, s, torch.float32) - x).abs()
    assert (err <= s.float()[..., None] / 2 + 1e-6 * x.abs()).all()
    assert torch.equal(dequantize_rows(codes, s, torch.float32)[0, 0], torch.zeros(64))


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_reference_ops_attend_over_the_dequantized_cache(op):
    q_lens = [5, 1, 7] if op == "prefill" else [1, 1, 1]
    c = make_case(q_lens, [9, 3, 20], H=4, Hkv=2, D=8, bs=4, dtype=torch.float32, seed=5)
    kc, vc, ks, vs = to_int8(c)
    if op == "prefill":
        out = torch.ops.llmaccel.paged_prefill_attention(
            c["q"], c["k"], c["v"], kc, vc, c["slot_mapping"], c["block_tables"], c["cu_seqlens_q"],
            c["context_lens"], ks, vs, scale=0.3, max_q_len=7)
    else:
        out = torch.ops.llmaccel.paged_decode_attention(
            c["q"], c["k"], c["v"], kc, vc, c["slot_mapping"], c["block_tables"], c["context_lens"],
            ks, vs, scale=0.3)
    # the oracle: the same codes dequantized into a plain cache, the new rows quantized and back
    plain = dict(c, k_cache=dequantize_rows(kc, ks, torch.float32), v_cache=dequantize_rows(vc, vs, torch.float32),
                 k=dequantize_rows(*quantize_rows(c["k"]), torch.float32),
                 v=dequantize_rows(*quantize_rows(c["v"]), torch.float32))
    torch.testing.assert_close(out, contiguous_ref(plain, 0.3), atol=1e-5, rtol=1e-5)
    codes, s = quantize_rows(c["k"])  # the written rows are the new keys' codes and scales
    assert torch.equal(kc.flatten(0, 1)[c["slot_mapping"]], codes)
    assert torch.equal(ks.flatten(0, 1)[c["slot_mapping"]], s)


def test_an_int8_cache_takes_both_scales_and_another_none():
    c = make_case([1], [5], H=2, Hkv=1, D=8, bs=4, dtype=torch.float32)
    kc, vc, ks, vs = to_int8(c)
    for args in ((kc, ks, None), (kc, None, None), (c["k_cache"], ks, vs)):
        with pytest.raises(ValueError, match="an int8 cache takes both"):
            pa.scale_args(*args)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_prefill_and_decode_on_int8_cache(dtype):
    c = make_case([20, 1, 3, 17], [20, 40, 70, 17], H=4, Hkv=2, D=16, bs=16, dtype=dtype, seed=7)
    kc, vc, ks, vs = to_int8(c)
    pa.write_kv_ref(c["k"], c["v"], kc, vc, c["slot_mapping"], ks, vs)
    args = (c["q"], kc, vc, c["block_tables"], c["cu_seqlens_q"], c["context_lens"], 16 ** -0.5)
    got = pa.paged_prefill_triton(*args, max_q_len=20, k_scale=ks, v_scale=vs)
    want = pa.paged_attention_ref(*args, ks, vs)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    d = make_case([1] * 4, [1, 17, 130, 64], H=8, Hkv=2, D=16, bs=16, dtype=dtype, seed=8)
    kc, vc, ks, vs = to_int8(d)
    args = (d["q"], kc, vc, d["block_tables"], d["context_lens"], 0.25)
    got = pa.paged_decode_triton(*args, num_splits=3, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.float(), pa.paged_decode_ref(*args, ks, vs).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


def _rope_run(fn, c, scales):
    kc, vc, ks, vs = (t.clone() for t in scales)
    out = fn(c["qkv"], None, None, kc, vc, c["pos"], c["bt"], c["cos"], c["sin"], 0.3, k_scale=ks, v_scale=vs)
    return out, kc, vc, ks, vs


@pytest.mark.parametrize("form", ["cpu", "masked", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_decode_forms_on_int8_cache(form, dtype):
    if form == "triton" and pr.triton is None:
        pytest.skip("triton not installed")
    c = rope_case([0, 7, 30, 17], H=6, Hkv=2, D=32, bs=4, width=8, dtype=dtype, fused=True,
                  seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    scales = to_int8(c, "kc", "vc")
    want, *w = _rope_run(pr.paged_rope_decode_ref, c, scales)
    fn = {"cpu": pr.paged_rope_decode_cpu, "masked": pr.paged_rope_decode_masked,
          "triton": lambda *a, **kw: pr.paged_rope_decode_triton(*a, num_splits=3, **kw)}[form]
    got, *g = _rope_run(fn, c, scales)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    for (codes, s), (codes_w, s_w) in ((g[0::2], w[0::2]), (g[1::2], w[1::2])):
        step = s_w.float()[..., None]
        diff = (dequantize_rows(codes, s, torch.float32) - dequantize_rows(codes_w, s_w, torch.float32)).abs()
        assert (diff <= step * 1.001 + 1e-6).all()


@pytest.mark.cuda
def test_int8_cache_kernels_real_shapes_bf16():
    """llama-1b's heads in bf16 on the GPU: the kernels (custom ops' CUDA forms) against the
    references in fp32 over the same codes."""
    H, Hkv, D = 32, 8, 64
    c = rope_case([0, 15, 16, 700, 1023, 333], H=H, Hkv=Hkv, D=D, bs=16, width=64, dtype=torch.bfloat16,
                  device="cuda", fused=True)
    scales = to_int8(c, "kc", "vc")
    got, *_ = _rope_run(pr.paged_rope_decode_triton, c, scales)
    want, *_ = _rope_run(pr.paged_rope_decode_ref, c, scales)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    p = make_case([1] * 8, [3000, 1, 17, 4096, 512, 2048, 64, 9], H=H, Hkv=Hkv, D=D, bs=16,
                  dtype=torch.bfloat16, device="cuda")
    kc, vc, ks, vs = to_int8(p)
    args = (p["q"], kc, vc, p["block_tables"], p["context_lens"], D ** -0.5)
    torch.testing.assert_close(pa.paged_decode_triton(*args, k_scale=ks, v_scale=vs).float(),
                               pa.paged_decode_ref(*args, ks, vs).float(), atol=3e-2, rtol=3e-2)


@needs_triton
def test_fp16_kernel_keeps_small_values():
    """Values of ~5e-4 in fp16: the kernels dequantize them in fp32 before the product, so the
    output keeps fp16's relative precision (a probability scaled by the row scale first would
    reach fp16's subnormals)."""
    d = make_case([1] * 2, [1024, 300], H=4, Hkv=2, D=16, bs=16, dtype=torch.float16, seed=9)
    d["v_cache"] = d["v_cache"] * 5e-4
    kc, vc, ks, vs = to_int8(d)
    args = (d["q"], kc, vc, d["block_tables"], d["context_lens"], 0.25)
    got = pa.paged_decode_triton(*args, num_splits=2, k_scale=ks, v_scale=vs).float()
    want = pa.paged_decode_ref(d["q"].float(), kc, vc, d["block_tables"], d["context_lens"], 0.25, ks, vs)
    assert ((got - want).abs().max() / want.abs().max()) < 3e-3
