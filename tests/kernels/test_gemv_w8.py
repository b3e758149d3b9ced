"""gemv_int8 (kernels/gemv_w8.py) against its reference, and the reference against linear_int8 on
x rounded as gemv_a8 rounds it. CPU: the Triton interpreter (signed dp4a spelled out) with every
fusion, ragged K (a part group), one and several rows, one tile and split over K; integer sums
until the scales, so fp32 rounding: 1e-5 of the largest |output|. GPU: llama-1b / llama2-7b
shapes in bf16 (1e-2)."""
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from llmaccel.kernels.gemv_a8 import quantize_groups  # noqa: E402
from llmaccel.ops.quant import linear_int8  # noqa: E402

w8 = pytest.importorskip("llmaccel.kernels.gemv_w8")
if w8.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)


def run(M, N, K, *, glu, eps, residual, split, dtype=torch.float32, device="cpu", words=256):
    g = torch.Generator().manual_seed(N + 7 * K)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g).to(device)
    s = (torch.rand(N, generator=g) * 0.01).to(device, dtype)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    r = torch.randn(M, N // 2 if glu else N, generator=g).to(device, dtype) if residual else None
    out = w8.gemv_int8_triton(x, q, s, None, r, eps=eps, glu=glu, split=split, words=words)
    return out, w8.gemv_int8_ref(x, q, s, None, r, eps=eps, glu=glu)


def close(out, ref, tol):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("K", [256, 200, 520])
@pytest.mark.parametrize("glu,eps,residual", [(False, None, False), (True, 1e-5, False), (False, 1e-5, True),
                                              (True, None, True)])
@pytest.mark.parametrize("split", [1, 2])
def test_kernel_matches_reference(K, glu, eps, residual, split):
    for M in (1, 2):
        close(*run(M, 32, K, glu=glu, eps=eps, residual=residual, split=split), 1e-5)


def test_reference_is_linear_int8_on_rounded_x():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (24, 300), dtype=torch.int8, generator=g)
    s = torch.rand(24, generator=g) * 0.01
    x = torch.randn(3, 300, generator=g)
    codes, d = quantize_groups(x, 128, 3)
    xq = (codes * d[..., None]).flatten(-2)[..., :300]
    torch.testing.assert_close(w8.gemv_int8_ref(x, q, s), linear_int8(xq, q, s), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        w8.gemv_int8(torch.randn(1, 6), torch.zeros(4, 6, dtype=torch.int8), torch.ones(4))


@pytest.mark.cuda
@pytest.mark.parametrize("N,K,glu,eps,residual", [(3072, 2048, False, 1e-5, False), (16384, 2048, True, 1e-5, False),
                                                   (2048, 8192, False, None, True), (4096, 11008, False, None, True)])
def test_kernel_cuda_real_shapes(N, K, glu, eps, residual):
    for split in (None, 1):
        close(*run(1, N, K, glu=glu, eps=eps, residual=residual, split=split, dtype=torch.bfloat16,
                   device="cuda", words=None), 1e-2)
