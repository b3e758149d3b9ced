"""KIVI kernels against the references in llmaccel.ops.kvquant.

CPU: the Triton kernels run under TRITON_INTERPRET=1 at small shapes, fp16/fp32 inputs.
GPU (@cuda): real Llama-1B decode shapes, bf16, through the custom ops.
Tolerances: packed codes may differ from the reference by one step where x sits at a rounding
tie (fused multiply-add); scales and mins equal to the storage dtype's rounding; attention
outputs to 2e-3 (fp32) / 1e-2 (fp16, bf16) of the output scale.
"""
import os

# TRITON_INTERPRET is set by tests/conftest.py when no GPU is present.

import pytest
import torch

from llmaccel.ops import kvquant as ref

kivi = pytest.importorskip("llmaccel.kernels.kivi")
if not kivi.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)
INTERPRETED = type(kivi._kivi_decode_kernel).__name__ == "InterpretedFunction"
cpu_kernels = pytest.mark.skipif(not INTERPRETED, reason="kernels were imported without TRITON_INTERPRET=1")


def _codes_close(packed, packed_ref, bits):
    a, b = ref.unpack(packed, bits).int(), ref.unpack(packed_ref, bits).int()
    diff = (a - b).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


@cpu_kernels
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_keys_kernel(bits, dtype):
    k = (torch.randn(6, 64, 32) * 3 + torch.randn(6, 1, 32)).to(dtype)
    p, s, m = kivi.quantize_keys_triton(k, bits, 16)
    pr, sr, mr = ref.quantize_keys(k, bits, 16)
    assert p.shape == pr.shape == (6, 64, 32 * bits // 8) and p.dtype == torch.uint8
    torch.testing.assert_close(s, sr, rtol=0, atol=0)
    torch.testing.assert_close(m, mr, rtol=0, atol=0)
    _codes_close(p, pr, bits)


@cpu_kernels
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_values_kernel(bits, dtype):
    v = (torch.randn(5, 40, 32) * 2).to(dtype)  # 40 tokens: a partial last block of 16
    p, s, m = kivi.quantize_values_triton(v, bits, 8)
    pr, sr, mr = ref.quantize_values(v, bits, 8)
    assert s.shape == (5, 40, 4)
    torch.testing.assert_close(s, sr, rtol=0, atol=0)
    torch.testing.assert_close(m, mr, rtol=0, atol=0)
    _codes_close(p, pr, bits)


def _random_cache(B, Hkv, D, Sq, Sr, bits, group, vgroup, dtype):
    k = torch.randn(B * Hkv, Sq, D).to(dtype)
    v = torch.randn(B * Hkv, Sq, D).to(dtype)
    kp, ks, km = ref.quantize_keys(k, bits, group)
    vp, vs, vm = ref.quantize_values(v, bits, vgroup)
    shape = lambda t: t.view(B, Hkv, *t.shape[1:])  # noqa: E731
    kr, vr = torch.randn(B, Hkv, Sr, D).to(dtype), torch.randn(B, Hkv, Sr, D).to(dtype)
    return [shape(t) for t in (kp, ks, km, vp, vs, vm)] + [kr, vr]


@cpu_kernels
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.float16, 1e-2)])
def test_decode_attention_kernel(bits, dtype, tol):
    B, H, Hkv, D, G = 2, 6, 2, 32, 8
    cache = _random_cache(B, Hkv, D, 48, 20, bits, G, 16, dtype)
    q = torch.randn(B, H, D).to(dtype)
    # per-sequence lengths: sequence 1 has fewer quantized and residual tokens than stored
    nq, nr = torch.tensor([48, 24]), torch.tensor([20, 7])
    kw = dict(scale=D ** -0.5, bits=bits, group=G, value_group=16)
    out = kivi.decode_attention_triton(q, *cache, nq, nr, block_n=16, target_programs=8, **kw)
    exp = ref.decode_attention_ref(q, *cache, nq, nr, **kw)
    torch.testing.assert_close(out.float(), exp.float(), rtol=0, atol=tol)


@cpu_kernels
def test_decode_attention_kernel_residual_only():
    # Fewer tokens than the residual window: nothing quantized yet.
    cache = _random_cache(1, 1, 16, 8, 5, 4, 8, 16, torch.float32)
    q = torch.randn(1, 2, 16)
    kw = dict(scale=0.25, bits=4, group=8, value_group=16)
    nq, nr = torch.tensor([0]), torch.tensor([5])
    out = kivi.decode_attention_triton(q, *cache, nq, nr, **kw)
    torch.testing.assert_close(out, ref.decode_attention_ref(q, *cache, nq, nr, **kw), rtol=0, atol=2e-3)


@cpu_kernels
def test_decode_kernel_reads_the_reference_cache_as_stored():
    # The kernel and QuantizedKVCache share one format: a decode step through the cache equals
    # the kernel run over the cache's own packed store and residual.
    spec = ref.make_spec(4, 8, 16, 32)
    cache = ref.QuantizedKVCache(2, 64, torch.float32, "cpu", {0: spec})
    kw = dict(n_heads=4, n_kv_heads=2, head_dim=32, scale=32 ** -0.5)
    x = torch.randn(2, 40, 64)
    cache.attend(0, torch.randn(2, 40, 128), x * 2, x.flip(1), **kw)
    cache.advance(40)
    q, (k, v) = torch.randn(2, 1, 128), torch.randn(2, 2, 1, 64).unbind(0)
    out = cache.attend(0, q, k, v, **kw)  # 41 tokens: 24 quantized, 17 residual
    st = cache.layers[0]
    assert st.n_q == 24
    n = torch.tensor([st.n_q] * 2), torch.tensor([st.kr.shape[2]] * 2)
    got = kivi.decode_attention_triton(q.view(2, 4, 32), st.kp, st.ks, st.km, st.vp, st.vs, st.vm,
                                       st.kr, st.vr, *n, scale=kw["scale"], bits=4, group=8,
                                       value_group=8, block_n=16)
    torch.testing.assert_close(got.view(2, 1, 128), out, rtol=0, atol=2e-3)


def test_custom_ops_on_cpu_are_the_references():
    k = torch.randn(3, 32, 16)
    for got, exp in zip(torch.ops.llmaccel.kivi_quantize_keys(k, 4, 8), ref.quantize_keys(k, 4, 8)):
        assert torch.equal(got, exp)
    for got, exp in zip(torch.ops.llmaccel.kivi_quantize_values(k, 2, 8), ref.quantize_values(k, 2, 8)):
        assert torch.equal(got, exp)
    cache = _random_cache(1, 1, 16, 16, 4, 4, 8, 16, torch.float32)
    q, n = torch.randn(1, 2, 16), (torch.tensor([16]), torch.tensor([4]))
    out = torch.ops.llmaccel.kivi_decode_attention(q, *cache, *n, 0.25, 4, 8, 16)
    assert torch.equal(out, ref.decode_attention_ref(q, *cache, *n, scale=0.25, bits=4, group=8,
                                                     value_group=16))


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_kernels_on_gpu_llama1b_shapes(bits):
    B, H, Hkv, D, G, S, R = 4, 32, 8, 64, 32, 4096, 128
    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(B * Hkv, S, D, device=dev, dtype=dt) * 2
    p, s, m = torch.ops.llmaccel.kivi_quantize_keys(k, bits, G)
    pr, sr, mr = ref.quantize_keys(k, bits, G)
    torch.testing.assert_close(s, sr, rtol=0, atol=0)
    _codes_close(p, pr, bits)
    p, s, m = torch.ops.llmaccel.kivi_quantize_values(k, bits, G)
    pr, sr, mr = ref.quantize_values(k, bits, G)
    torch.testing.assert_close(m, mr, rtol=0, atol=0)
    _codes_close(p, pr, bits)
    cache = [t.to(dev) for t in _random_cache(B, Hkv, D, S, R + G, bits, G, G, dt)]
    q = torch.randn(B, H, D, device=dev, dtype=dt)
    nq = torch.tensor([S, S - G, 1024, 0], device=dev)
    nr = torch.tensor([R, R + 5, R + G - 1, 17], device=dev)
    kw = dict(scale=D ** -0.5, bits=bits, group=G, value_group=G)
    out = torch.ops.llmaccel.kivi_decode_attention(q, *cache, nq, nr, D ** -0.5, bits, G, G)
    exp = ref.decode_attention_ref(q, *cache, nq, nr, **kw)
    torch.testing.assert_close(out.float(), exp.float(), rtol=0, atol=1e-2)
