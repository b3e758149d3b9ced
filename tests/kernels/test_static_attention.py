"""Static-cache decode attention (KV write folded in) against the reference.

CPU: the Triton interpreter (TRITON_INTERPRET=1) at small shapes in fp32 and fp16 (the
interpreter mishandles bf16 in tl.dot), with and without splits, at the first, a middle and the
last slot. Reference: index_copy_ of k, v at pos, then masked attention over slots 0 .. pos.
Tolerance: fp32 1e-5 (summation order); fp16 / bf16 2e-2 of the largest |output| (rounding of
q K^T and of p before the V product). The caches must match exactly (a store of the same values).
GPU: real shapes in bf16, and the custom op.
"""
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sa = pytest.importorskip("llmaccel.kernels.static_attention")
INTERPRETED = sa.triton is not None and type(sa._static_decode_kernel).__name__ == "InterpretedFunction"


def case(B, H, Hkv, D, S, pos, dtype, device="cpu", cache_dtype=None):
    g = torch.Generator().manual_seed(B * 1000 + H * 100 + S + pos)
    q = torch.randn(B, H, D, generator=g).to(device, dtype)
    k = torch.randn(B, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(B, Hkv, D, generator=g).to(device, dtype)
    kc = torch.randn(B, Hkv, S, D, generator=g).to(device, cache_dtype or dtype)
    vc = torch.randn(B, Hkv, S, D, generator=g).to(device, cache_dtype or dtype)
    return q, k, v, kc, vc, torch.tensor([pos], device=device)


def check(out, ref, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("B,H,Hkv,D,S", [(1, 9, 3, 64, 200), (2, 4, 4, 32, 64), (1, 8, 2, 48, 130)])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("splits", [1, 3, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_static_decode_interpreter(B, H, Hkv, D, S, where, splits, dtype):
    pos = {"first": 0, "middle": S // 2 + 1, "last": S - 1}[where]
    q, k, v, kc, vc, p = case(B, H, Hkv, D, S, pos, dtype)
    kr, vr = kc.clone(), vc.clone()
    ref = sa.static_decode_ref(q, k, v, kr, vr, p, 0.125)
    # slots past pos may hold anything: never in the output
    kc[:, :, pos + 1:] = float("nan")
    vc[:, :, pos + 1:] = float("inf")
    out = sa.static_decode_triton(q, k, v, kc, vc, p, 0.125, num_splits=splits)
    check(out, ref, dtype)
    assert torch.equal(kc[:, :, :pos + 1], kr[:, :, :pos + 1])
    assert torch.equal(vc[:, :, :pos + 1], vr[:, :, :pos + 1])


def test_custom_op_on_cpu_writes_the_cache_and_attends():
    q, k, v, kc, vc, p = case(2, 6, 3, 16, 40, 7, torch.float32)
    out = torch.ops.llmaccel.static_decode_attention(q, k, v, kc, vc, p, scale=0.25)
    assert torch.equal(kc[:, :, 7], k) and torch.equal(vc[:, :, 7], v)
    # slot 7 attended to, slots past it not: changing them leaves the output alone
    kc[:, :, 8:] = 1e4
    again = torch.ops.llmaccel.static_decode_attention(q, k, v, kc, vc, p, scale=0.25)
    assert torch.allclose(out, again)


def test_shape_mismatch_is_rejected():
    if sa.triton is None:
        pytest.skip("triton missing")
    q, k, v, kc, vc, p = case(1, 6, 3, 16, 40, 7, torch.float32)
    with pytest.raises(ValueError, match="disagree"):
        sa.static_decode_triton(q[:, :5], k, v, kc, vc, p, 0.25)


@pytest.mark.cuda
@pytest.mark.parametrize("B,H,Hkv,D,S", [(1, 9, 3, 64, 448), (1, 32, 8, 64, 448), (64, 32, 8, 64, 448),
                                         (1, 32, 32, 128, 4160), (4, 32, 8, 64, 8192)])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_static_decode_cuda(B, H, Hkv, D, S, where):
    pos = {"first": 0, "middle": S // 2 + 1, "last": S - 1}[where]
    q, k, v, kc, vc, p = case(B, H, Hkv, D, S, pos, torch.bfloat16, "cuda")
    kr, vr = kc.clone(), vc.clone()
    ref = sa.static_decode_ref(q.float(), k, v, kr, vr, p, D ** -0.5)
    out = torch.ops.llmaccel.static_decode_attention(q, k, v, kc, vc, p, scale=D ** -0.5)
    check(out, ref, torch.bfloat16)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def rope_case(B, H, Hkv, D, S, pos, dtype, device="cpu"):
    """q, k, v as views of one fused qkv row (B, (H + 2 Hkv) D), as the decode graph hands
    them over, and fp32 rope tables for S positions."""
    from llmaccel.codegen.lower import rope_tables

    g = torch.Generator().manual_seed(7 * S + pos + B)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g).to(device, dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    views = q.view(B, H, D), k.view(B, Hkv, D), v.view(B, Hkv, D)
    kc = torch.randn(B, Hkv, S, D, generator=g).to(device, dtype)
    vc = torch.randn(B, Hkv, S, D, generator=g).to(device, dtype)
    cos, sin = rope_tables(D, 10000.0, None, S, device)
    return views, kc, vc, torch.tensor([pos], device=device), cos, sin


def test_rope_reference_is_ops_rope():
    from llmaccel import ops

    B, H, D, pos = 2, 4, 16, 9
    x = torch.randn(B, H, D, dtype=torch.float64)
    cos, sin = __import__("llmaccel.codegen.lower", fromlist=["rope_tables"]).rope_tables(
        D, 10000.0, None, 32, "cpu")
    got = sa.rope_at(x, cos.double(), sin.double(), torch.tensor([pos]))
    want = ops.rope(x.reshape(B, 1, H * D), torch.full((B, 1), pos), head_dim=D, theta=10000.0)
    torch.testing.assert_close(got, want.view(B, H, D), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("B,H,Hkv,D,S", [(1, 9, 3, 64, 200), (2, 8, 2, 48, 130)])
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
def test_static_decode_rope_interpreter(B, H, Hkv, D, S, where, splits, dtype, packed):
    pos = {"first": 0, "last": S - 1}[where]
    (q, k, v), kc, vc, p, cos, sin = rope_case(B, H, Hkv, D, S, pos, dtype)
    kr, vr = kc.clone(), vc.clone()
    ref = sa.static_decode_ref(q, k, v, kr, vr, p, 0.125, cos, sin)
    if packed:  # the fused projection's rows as one tensor, k = v = None
        q, k, v = torch.cat([q, k, v], dim=1), None, None
    out = sa.static_decode_triton(q, k, v, kc, vc, p, 0.125, cos, sin, num_splits=splits)
    check(out, ref, dtype)
    # the rotated key is what lands in the cache
    assert torch.equal(kc[:, :, :pos + 1], kr[:, :, :pos + 1])
    assert torch.equal(vc[:, :, :pos + 1], vr[:, :, :pos + 1])


def test_rope_tables_must_cover_the_cache():
    if sa.triton is None:
        pytest.skip("triton missing")
    (q, k, v), kc, vc, p, cos, sin = rope_case(1, 4, 2, 16, 40, 3, torch.float32)
    with pytest.raises(ValueError, match="rope tables"):
        sa.static_decode_triton(q, k, v, kc, vc, p, 0.25, cos[:20], sin[:20])


@pytest.mark.cuda
@pytest.mark.parametrize("B,H,Hkv,D,S", [(1, 9, 3, 64, 448), (1, 32, 8, 64, 448), (64, 32, 8, 64, 448),
                                         (1, 32, 32, 128, 4160)])
@pytest.mark.parametrize("where", ["first", "last"])
def test_static_decode_rope_cuda(B, H, Hkv, D, S, where):
    pos = {"first": 0, "last": S - 1}[where]
    (q, k, v), kc, vc, p, cos, sin = rope_case(B, H, Hkv, D, S, pos, torch.bfloat16, "cuda")
    kr, vr = kc.clone(), vc.clone()
    ref = sa.static_decode_ref(q, k, v, kr, vr, p, D ** -0.5, cos, sin)
    out = torch.ops.llmaccel.static_decode_attention(q, k, v, kc, vc, p, cos=cos, sin=sin, scale=D ** -0.5)
    check(out, ref, torch.bfloat16)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    packed = torch.ops.llmaccel.static_decode_attention(torch.cat([q, k, v], dim=1), None, None, kc, vc, p,
                                                        cos=cos, sin=sin, scale=D ** -0.5)
    assert torch.equal(packed, out)
