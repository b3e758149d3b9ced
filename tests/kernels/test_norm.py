"""The RMSNorm kernel (with and without the residual add) against the reference ops.

CPU: the Triton kernel under TRITON_INTERPRET=1 at small shapes, fp32 and fp16, with and without
a weight, rows of a power of two and not, a strided view of rows. GPU (@cuda): llama-1b's hidden
size, bf16, through the custom ops. Tolerances: fp32 1e-5 relative (another summation order of
the mean); fp16/bf16: the sum and the normalised row round as the reference's, so a difference is
one rounding step of the output dtype where the fp32 statistics differ in the last bits.
"""
import pytest
import torch

from llmaccel import ops

kern = pytest.importorskip("llmaccel.kernels.norm")
if kern.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)
INTERPRETED = type(kern._rms_norm_kernel).__name__ == "InterpretedFunction"
cpu_kernels = pytest.mark.skipif(not INTERPRETED, reason="kernels were imported without TRITON_INTERPRET=1")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1e-2, atol=1.6e-2)}


def _inputs(shape, dtype, device, weighted):
    """Fresh random inputs (from the seed tests/conftest.py sets for each test)."""
    x = (torch.randn(shape) * 3).to(dtype).to(device)
    r = torch.randn(shape).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype).to(device) if weighted else None
    return x, r, w


def _check(x, r, w, eps=1e-5):
    out = kern.rms_norm_triton(x, w, eps)
    exp = ops.rms_norm(x, w, eps=eps)
    assert out.dtype == exp.dtype and out.shape == exp.shape
    torch.testing.assert_close(out, exp, **TOL[x.dtype])
    out, s = kern.rms_norm_triton(x, w, eps, r)
    exp, es = ops.add_rms_norm(x, r, w, eps=eps)
    assert torch.equal(s, es)  # one rounded add, as the reference's
    torch.testing.assert_close(out, exp, **TOL[x.dtype])


@cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 5, 64), (3, 48), (2, 7, 100)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_kernel_matches_reference(dtype, shape, weighted):
    _check(*_inputs(shape, dtype, "cpu", weighted))


@cpu_kernels
def test_rms_norm_kernel_reads_strided_rows():
    x, r, w = _inputs((6, 2, 64), torch.float32, "cpu", True)
    _check(x[:, 1], r[:, 0], w)          # rows 128 elements apart
    _check(x.transpose(0, 1), r.transpose(0, 1), w)


def test_cpu_ops_are_the_reference():
    x, r, w = _inputs((2, 3, 32), torch.float32, "cpu", True)
    assert torch.equal(torch.ops.llmaccel.rms_norm(x, w, eps=1e-6), ops.rms_norm(x, w, eps=1e-6))
    a, b = torch.ops.llmaccel.add_rms_norm(x, r, w, eps=1e-6)
    ea, eb = ops.add_rms_norm(x, r, w, eps=1e-6)
    assert torch.equal(a, ea) and torch.equal(b, eb)


def test_only_eager_lowering_maps_the_norms():
    from llmaccel.codegen.lower import lower
    from llmaccel.compiler.model import load
    m = load("preset:tiny-llama", dtype=torch.float32, device="cpu")
    norms = {ops.rms_norm, ops.add_rms_norm}
    for select in ("all", "eager"):
        gm, rep = lower(m.gm, max_len=64, select=select)
        kept = sum(n.op == "call_function" and n.target in norms for n in gm.graph.nodes)
        assert kept > 0  # on the CPU both keep the reference (the eager one as its CPU form)
        assert ("rms_norm" in rep.cpu_traced or "add_rms_norm" in rep.cpu_traced) == (select == "eager")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_ops_match_reference(dtype):
    for shape in ((1, 8192, 2048), (1, 3, 576), (5, 4096)):
        x, r, w = _inputs(shape, dtype, "cuda", True)
        out = torch.ops.llmaccel.rms_norm(x, w, eps=1e-5)
        torch.testing.assert_close(out, ops.rms_norm(x, w, eps=1e-5), **TOL[dtype])
        a, s = torch.ops.llmaccel.add_rms_norm(x, r, w, eps=1e-5)
        ea, es = ops.add_rms_norm(x, r, w, eps=1e-5)
        assert torch.equal(s, es)
        torch.testing.assert_close(a, ea, **TOL[dtype])
