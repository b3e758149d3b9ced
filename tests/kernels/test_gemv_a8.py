"""gemv_int4 with int8 activations (kernels/gemv_a8.py) against its reference, and the reference
against the exact int4 GEMV on x rounded as it rounds.

CPU: the Triton interpreter (dp4a spelled out on the same packed words) at small shapes with
every fusion (norm prologue, glu, bias, residual), group sizes 32-128, ragged K (a zero-padded
last group), one and several rows, one tile and split over K (partials summed by the last
program of a tile). The sums are exact integers until the per-group scale, so the tolerance is
fp32 rounding: 1e-5 of the largest |output|. GPU: llama-1b and llama2-7b shapes in bf16 (one
rounding of the output: 1e-2).
"""
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from llmaccel.kernels.gemv import gemv_int4_ref  # noqa: E402

a8 = pytest.importorskip("llmaccel.kernels.gemv_a8")
if a8.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)


def q4(N, K, gs, g, device="cpu"):
    G = -(-K // gs)
    return (torch.randint(0, 256, (N, G, gs // 2), dtype=torch.uint8, generator=g).to(device),
            (torch.rand(N, G, generator=g) * 0.02).to(device, torch.bfloat16),
            torch.randint(0, 256, (N, -(-G // 2)), dtype=torch.uint8, generator=g).to(device))


def run(M, N, K, gs, *, glu, eps, bias, residual, split, dtype=torch.float32, device="cpu", seed=0, words=256):
    g = torch.Generator().manual_seed(seed + 31 * N + K)
    w, s, z = q4(N, K, gs, g, device)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    n_out = N // 2 if glu else N
    b = (0.1 * torch.randn(N, generator=g)).to(device, dtype) if bias else None
    r = torch.randn(M, n_out, generator=g).to(device, dtype) if residual else None
    kw = dict(group_size=gs, eps=eps, glu=glu)
    out = a8.gemv_a8_triton(x, w, s, z, b, r, split=split, words=words, **kw)
    return out, a8.gemv_a8_ref(x, w, s, z, b, r, **kw), (x, w, s, z, b, r, kw)


def close(out, ref, tol):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("gs,K", [(128, 256), (32, 200), (64, 1000)])
@pytest.mark.parametrize("glu,eps,bias,residual", [(False, None, False, False), (True, 1e-5, False, False),
                                                   (False, 1e-5, True, True), (True, None, True, True)])
@pytest.mark.parametrize("split", [1, 3])
def test_kernel_matches_reference(gs, K, glu, eps, bias, residual, split):
    for M in (1, 3):
        out, ref, _ = run(M, 48, K, gs, glu=glu, eps=eps, bias=bias, residual=residual, split=split)
        close(out, ref, 1e-5)


def test_split_sums_are_deterministic_and_counters_reset():
    a, ref, args = run(2, 64, 700, 32, glu=True, eps=1e-5, bias=False, residual=True, split=4)
    x, w, s, z, b, r, kw = args
    for _ in range(2):  # the counters were re-zeroed, the partials are added in split order
        assert torch.equal(a8.gemv_a8_triton(x, w, s, z, b, r, split=4, words=256, **kw), a)


def test_reference_is_the_exact_gemv_on_rounded_x():
    g = torch.Generator().manual_seed(3)
    w, s, z = q4(40, 300, 64, g)
    x = torch.randn(2, 300, generator=g) * torch.linspace(0.01, 30, 300)  # groups of unlike size
    codes, d = a8.quantize_groups(x, 64, w.shape[1])
    assert codes.abs().max() <= 127 and torch.equal(codes, codes.round())
    xq = (codes * d[..., None]).flatten(-2)[..., :300]
    assert ((xq - x).abs() <= d.repeat_interleave(64, -1)[..., :300] / 2 + 1e-6).all()  # half a step
    torch.testing.assert_close(a8.gemv_a8_ref(x, w, s, z, group_size=64),
                               gemv_int4_ref(xq, w, s, z, group_size=64), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("N,K,glu,eps,residual", [(3072, 2048, False, 1e-5, False), (16384, 2048, True, 1e-5, False),
                                                   (2048, 8192, False, None, True), (4096, 11008, False, None, True)])
@pytest.mark.parametrize("split", [1, 4])
def test_kernel_cuda_real_shapes(N, K, glu, eps, residual, split):
    out, ref, _ = run(1, N, K, 128, glu=glu, eps=eps, bias=False, residual=residual, split=split,
                      dtype=torch.bfloat16, device="cuda", words=16384)
    close(out, ref, 1e-2)
