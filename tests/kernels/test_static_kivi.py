"""Static KIVI decode attention (KV write and group ageing folded in) against the references.

Reference chain: static_kivi_prefill + static_kivi_decode_ref reproduce ops.kvquant's
QuantizedKVCache (the cache `llmc eval` measures quality through) step by step: same outputs
(fp32, 1e-5) and the same stored codes. The Triton kernel (TRITON_INTERPRET=1 on the CPU, small
shapes, fp32 and fp16: the interpreter mishandles bf16 in tl.dot) against the reference for one
decode step from caches filled to positions before, at and after a group ages: outputs within
1e-5 (fp32) / 2e-2 of the largest |output| (fp16: rounding of q K^T and of p), and every buffer
equal (the interpreter rounds each operation as the reference does). GPU: real shapes in bf16,
where a fused multiply-add may move a code at a rounding tie (a few codes allowed).
"""
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from llmaccel.ops.kvquant import QuantizedKVCache, make_spec, quantized_len  # noqa: E402

sk = pytest.importorskip("llmaccel.kernels.static_kivi")
import llmaccel.kernels.kivi  # noqa: E402,F401  (registers the quantize ops the prefill uses)

INTERPRETED = sk.triton is not None and type(sk._static_kivi_kernel).__name__ == "InterpretedFunction"


def empty_cache(B, Hkv, D, max_len, spec, dtype, device="cpu"):
    shapes = sk.cache_shapes(B, Hkv, D, max_len, spec)
    return [torch.zeros(shapes[n], dtype=torch.uint8 if n in ("kp", "vp") else dtype, device=device)
            for n in sk.CACHE_NAMES]


def kw(spec, scale):
    return dict(scale=scale, bits=spec["bits"], group=spec["group"], value_group=spec["value_group"],
                residual=spec["residual"])


def filled(B, H, Hkv, D, P, spec, dtype, max_len, device="cpu", seed=0):
    """A cache holding P tokens (prefill), the next token's q, k, v and pos."""
    g = torch.Generator().manual_seed(seed + P)
    cache = empty_cache(B, Hkv, D, max_len, spec, dtype, device)
    if P:
        k = torch.randn(B, Hkv, P, D, generator=g).to(device, dtype)
        v = torch.randn(B, Hkv, P, D, generator=g).to(device, dtype)
        sk.static_kivi_prefill(k, v, *cache, spec)
    q = torch.randn(B, H, D, generator=g).to(device, dtype)
    kn = torch.randn(B, Hkv, D, generator=g).to(device, dtype)
    vn = torch.randn(B, Hkv, D, generator=g).to(device, dtype)
    return cache, q, kn, vn, torch.tensor([P], device=device)


@pytest.mark.parametrize("bits,group,residual,D", [(2, 16, 32, 64), (4, 8, 16, 32), (2, 16, 0, 32)])
def test_reference_follows_the_quantized_cache(bits, group, residual, D):
    B, H, Hkv, T0, steps = 2, 4, 2, 37, 40
    spec = make_spec(bits, group, residual, D)
    g = torch.Generator().manual_seed(7)
    L = T0 + steps
    q = torch.randn(B, L, H * D, generator=g)
    k = torch.randn(B, L, Hkv * D, generator=g)
    v = torch.randn(B, L, Hkv * D, generator=g)
    ref = QuantizedKVCache(B, L, torch.float32, "cpu", {0: spec})
    cache = empty_cache(B, Hkv, D, L, spec, torch.float32)
    heads = dict(n_heads=H, n_kv_heads=Hkv, head_dim=D, scale=D ** -0.5)
    ref.attend(0, q[:, :T0], k[:, :T0], v[:, :T0], **heads)
    ref.advance(T0)
    split = lambda x, n: x.view(B, -1, n, D).transpose(1, 2)  # noqa: E731
    keys, values = sk.static_kivi_prefill(split(k[:, :T0], Hkv), split(v[:, :T0], Hkv), *cache, spec)
    kc, vc = ref.layers[0].keys_values()
    assert torch.equal(keys, kc) and torch.equal(values, vc)
    for t in range(T0, L):
        want = ref.attend(0, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], **heads)
        ref.advance(1)
        got = torch.ops.llmaccel.static_kivi_decode(
            q[:, t].view(B, H, D), k[:, t].view(B, Hkv, D), v[:, t].view(B, Hkv, D), *cache,
            torch.tensor([t]), **kw(spec, D ** -0.5))
        torch.testing.assert_close(got, want.view(B, H, D), atol=1e-5, rtol=1e-5)
    st, nq = ref.layers[0], quantized_len(L, spec)
    assert st.n_q == nq
    assert torch.equal(cache[0][:, :, :nq], st.kp[:, :, :nq])
    assert torch.equal(cache[3][:, :, :nq], st.vp[:, :, :nq])


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("bits,group,residual,D,H,Hkv", [(2, 16, 32, 64, 8, 2), (4, 8, 16, 32, 3, 1),
                                                         (2, 16, 0, 32, 4, 4)])
@pytest.mark.parametrize("where", ["empty", "before", "ages", "after", "full"])
@pytest.mark.parametrize("dtype,prefetch", [(torch.float32, True), (torch.float16, True),
                                            (torch.float32, False)])
def test_kernel_interpreter(bits, group, residual, D, H, Hkv, where, dtype, prefetch):
    spec = make_spec(bits, group, residual, D)
    max_len = 96
    ages = residual + 2 * group - 1  # token pos = ages makes the second group age
    P = {"empty": 0, "before": ages - 1, "ages": ages, "after": ages + 3, "full": max_len - 1}[where]
    cache, q, k, v, pos = filled(2, H, Hkv, D, P, spec, dtype, max_len)
    mine = [t.clone() for t in cache]
    ref = sk.static_kivi_decode_ref(q, k, v, *cache, pos, **kw(spec, 0.3))
    out = sk.static_kivi_triton(q, k, v, *mine, pos, **kw(spec, 0.3), block_n=32, num_splits=2,
                                prefetch=prefetch)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err
    for name, a, b in zip(sk.CACHE_NAMES, mine, cache):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
def test_kernel_shape_errors():
    spec = make_spec(2, 16, 32, 64)
    cache, q, k, v, pos = filled(1, 4, 2, 64, 5, spec, torch.float32, 64)
    with pytest.raises(ValueError, match="disagree"):
        sk.static_kivi_triton(q, k[:, :1], v, *cache, pos, **kw(spec, 0.1))
    spec48 = make_spec(2, 16, 32, 48)
    cache, q, k, v, pos = filled(1, 4, 2, 48, 5, spec48, torch.float32, 64)
    with pytest.raises(ValueError, match="power-of-two"):
        sk.static_kivi_triton(q, k, v, *cache, pos, **kw(spec48, 0.1))


@pytest.mark.cuda
@pytest.mark.parametrize("B,H,Hkv,D,P", [(64, 32, 8, 64, 4100), (1, 32, 8, 64, 300), (2, 32, 32, 128, 1000),
                                         (4, 9, 3, 64, 143)])
def test_kernel_cuda(B, H, Hkv, D, P):
    spec = make_spec(2, 16, 128, D)
    dt = torch.bfloat16
    cache, q, k, v, pos = filled(B, H, Hkv, D, P, spec, dt, P + 64, device="cuda")
    mine = [t.clone() for t in cache]
    ref = sk.static_kivi_decode_ref(q, k, v, *cache, pos, **kw(spec, D ** -0.5))
    out = torch.ops.llmaccel.static_kivi_decode(q, k, v, *mine, pos, **kw(spec, D ** -0.5))
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2e-2 * max(1.0, ref.float().abs().max().item()), err
    for name, a, b in zip(sk.CACHE_NAMES, mine, cache):
        if name in ("kp", "vp"):  # codes may move at a rounding tie
            assert (a != b).float().mean().item() < 1e-3, name
        else:
            torch.testing.assert_close(a, b, atol=0, rtol=1e-2, msg=name)
