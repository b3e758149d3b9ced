"""linear_int4 / linear_int8 Triton kernels against the reference ops.

CPU: the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported) at small shapes,
fp32 and fp16 inputs (the interpreter mishandles bf16 in tl.dot). Tolerances: fp32 1e-4 of the
output scale (accumulation order); fp16/bf16 2e-2 relative (output rounding and fp16 dot
inputs). GPU tests run the real kernels at Llama-1B shapes.
"""
import os

import torch  # importing torch alone does not import triton

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from llmaccel.ops import quant as qo  # noqa: E402

ql_mod = pytest.importorskip("llmaccel.kernels.quant_linear")
INTERPRETED = ql_mod.triton is not None and \
    type(ql_mod._linear_int4_gemv_kernel).__name__ == "InterpretedFunction"


@pytest.fixture(scope="module")
def ql():
    if not INTERPRETED:
        pytest.skip("triton missing, or kernels imported without TRITON_INTERPRET=1")
    return ql_mod


def int4_weights(N, K, gs, dtype=torch.float32, device="cpu"):
    G = -(-K // gs)
    qw = torch.randint(0, 256, (N, G, gs // 2), dtype=torch.uint8, device=device)
    sc = (torch.rand(N, G, device=device) * 0.02 + 0.005).to(dtype)
    zr = torch.randint(0, 256, (N, -(-G // 2)), dtype=torch.uint8, device=device)
    return qw, sc, zr


def close(out, ref, dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * ref.float().abs().max().item() + 1e-6, (err, ref.abs().max().item())


# (M, N, K, group_size): decode-sized M takes the GEMV path, larger M the GEMM path;
# K not a multiple of group_size exercises the zero-padded last group.
SHAPES = [(1, 48, 128, 32), (3, 40, 200, 64), (16, 24, 96, 32), (20, 36, 160, 128), (33, 65, 64, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,gs", SHAPES)
def test_int4_interpreter(ql, M, N, K, gs, dtype):
    qw, sc, zr = int4_weights(N, K, gs, dtype)
    x, b = torch.randn(M, K).to(dtype), torch.randn(N).to(dtype)
    out = ql.linear_int4_triton(x, qw, sc, zr, b, group_size=gs)
    ref = qo.linear_int4(x.float(), qw, sc.float(), zr, b.float(), group_size=gs)
    assert out.dtype == dtype and out.shape == (M, N)
    close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,gs", SHAPES[:3])
def test_int8_interpreter(ql, M, N, K, gs, dtype):
    q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    s8 = (torch.rand(N) * 0.01).to(dtype)
    x = torch.randn(2, (M + 1) // 2, K).to(dtype)           # leading dims are flattened
    out = ql.linear_int8_triton(x, q8, s8)
    close(out, qo.linear_int8(x.float(), q8, s8.float()), dtype)


def test_split_k_gemv_interpreter(ql):
    qw, sc, zr = int4_weights(20, 512, 64)
    x = torch.randn(2, 512)
    cfg = dict(BLOCK_M=2, BLOCK_N=8, BLOCK_K=64, SPLIT_K=4, num_warps=4)
    out = ql.linear_int4_triton(x, qw, sc, zr, group_size=64, config=cfg)
    close(out, qo.linear_int4(x, qw, sc, zr, group_size=64), torch.float32)
    q8, s8 = torch.randint(-127, 128, (20, 512), dtype=torch.int8), torch.rand(20) * 0.01
    close(ql.linear_int8_triton(x, q8, s8, config=cfg), qo.linear_int8(x, q8, s8), torch.float32)


def test_custom_ops_on_cpu_are_the_reference(ql):
    qw, sc, zr = int4_weights(8, 64, 32)
    x = torch.randn(3, 64)
    torch.testing.assert_close(torch.ops.llmaccel.linear_int4(x, qw, sc, zr, None, group_size=32),
                               qo.linear_int4(x, qw, sc, zr, group_size=32))
    q8, s8 = torch.randint(-127, 128, (8, 64), dtype=torch.int8), torch.rand(8)
    torch.testing.assert_close(torch.ops.llmaccel.linear_int8(x, q8, s8, None), qo.linear_int8(x, q8, s8))


def test_shape_mismatch_is_rejected(ql):
    qw, sc, zr = int4_weights(8, 64, 32)
    with pytest.raises(ValueError, match="disagree"):
        ql.linear_int4_triton(torch.randn(1, 96), qw, sc, zr, group_size=32)


# --- GPU, real shapes (Llama-3.2-1B: hidden 2048, intermediate 8192, vocab 128256) -----------------

GPU_SHAPES = [(2048, 8192), (8192, 2048), (2048, 128256)]   # (K, N)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("K,N", GPU_SHAPES)
def test_int4_cuda(M, K, N):
    from llmaccel.kernels import quant_linear as ql

    qw, sc, zr = int4_weights(N, K, 128, torch.bfloat16, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    out = torch.ops.llmaccel.linear_int4(x, qw, sc, zr, None, group_size=128)
    ref = qo.linear_int4(x.float(), qw, sc.float(), zr, group_size=128)
    close(out, ref, torch.bfloat16)
    assert ql.triton is not None


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 16, 512])
@pytest.mark.parametrize("K,N", GPU_SHAPES)
def test_int8_cuda(M, K, N):
    q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
    s8 = (torch.rand(N, device="cuda") * 0.01).to(torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    out = torch.ops.llmaccel.linear_int8(x, q8, s8, None)
    close(out, qo.linear_int8(x.float(), q8, s8.float()), torch.bfloat16)
