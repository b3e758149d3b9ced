"""sparse_down kernel against the reference (llmaccel.ops.sparse.sparse_down = dense product).

CPU: the Triton kernel under TRITON_INTERPRET=1 at small shapes, fp32 and fp16 inputs, with
activations at several sparsities (including all-zero rows and blocks of tokens whose union of
non-zero channels differs). GPU (@cuda): SmolLM2-135M and Llama-1B down-projection shapes, bf16
and fp16, decode and small-batch token counts, through the custom op.
Tolerances: fp32 1e-5 of the output scale (fp32 accumulation, another summation order);
fp16/bf16 inputs: the kernel accumulates in fp32 and rounds once, the reference is computed in
fp32 here, so 1e-2 of the output scale.
"""
import os

# TRITON_INTERPRET is set by tests/conftest.py when no GPU is present.

import pytest
import torch

from llmaccel.ops.sparse import sparse_down as ref

kern = pytest.importorskip("llmaccel.kernels.sparse_down")
if not kern.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)
INTERPRETED = type(kern._sparse_down_kernel).__name__ == "InterpretedFunction"
cpu_kernels = pytest.mark.skipif(not INTERPRETED, reason="kernels were imported without TRITON_INTERPRET=1")


def _acts(shape, sparsity, dtype, device="cpu"):
    x = torch.relu(torch.randn(shape, device=device))
    x = torch.where(torch.rand(shape, device=device) < sparsity, 0.0, x + 0.1)
    return x.to(dtype)


def _check(out, x, w, b, rel):
    exp = ref(x.float(), w.float(), None if b is None else b.float())
    scale = exp.abs().max().item() + 1e-6
    torch.testing.assert_close(out.float(), exp, rtol=0, atol=rel * scale)


@cpu_kernels
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize("M,sparsity", [(1, 0.9), (3, 0.6), (21, 0.0), (17, 1.0)])
def test_kernel_matches_reference(dtype, rel, M, sparsity):
    K, N = 200, 72  # neither a multiple of the blocks
    x = _acts((M, K), sparsity, dtype)
    w = (0.1 * torch.randn(K, N)).to(dtype)
    b = torch.randn(N).to(dtype) if M % 2 else None
    out = kern.sparse_down_triton(x, w, b)
    assert out.shape == (M, N) and out.dtype == dtype
    _check(out, x, w, b, rel)


@cpu_kernels
def test_kernel_3d_input_and_custom_op_cpu():
    x = _acts((2, 3, 96), 0.7, torch.float32)
    w = torch.randn(96, 40)
    out = kern.sparse_down_triton(x, w)
    assert out.shape == (2, 3, 40)
    _check(out, x, w, None, 1e-5)
    # the CPU custom op is the reference itself
    torch.testing.assert_close(torch.ops.llmaccel.sparse_down(x, w, None, 0.7), ref(x, w))


def test_fake_tensor_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        out = torch.ops.llmaccel.sparse_down(torch.empty(4, 7, 64), torch.empty(64, 32), None, 0.5)
    assert out.shape == (4, 7, 32)


def test_shape_errors():
    with pytest.raises(ValueError, match="channels"):
        kern.sparse_down_triton(torch.zeros(2, 8), torch.zeros(9, 4))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K,N", [(1536, 576), (8192, 2048)])  # SmolLM2-135M, Llama-1B
@pytest.mark.parametrize("M", [1, 4, 16, 48, 256])
def test_cuda_custom_op(dtype, K, N, M):
    x = _acts((M, K), 0.65, dtype, "cuda")
    w = (0.02 * torch.randn(K, N, device="cuda")).to(dtype)
    b = torch.randn(N, device="cuda").to(dtype)
    _check(torch.ops.llmaccel.sparse_down(x, w, b, 0.65), x, w, b, 1e-2)
    if M < kern.DENSE_MIN_TOKENS:  # the Triton path itself, too
        _check(kern.sparse_down_triton(x, w, b), x, w, b, 1e-2)
