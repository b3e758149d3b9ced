"""linear_attention (SLA prefill) kernel against the reference (llmaccel.ops.sla.sla_forward).

CPU: the Triton kernel under TRITON_INTERPRET=1 at small shapes (several chunks, a ragged last
chunk, GQA, a head_dim that is not a power of two, conv weights per query head and per KV head),
fp32 and fp16 inputs. GPU (@cuda): SmolLM2-135M (9 heads, 3 KV heads, head_dim 64) and Llama-1B
(32/8/64) at T=512 and 2048, bf16 and fp16, through the custom op.
Tolerances, relative to the output's max magnitude: fp32 inputs 1e-5 (IEEE dots, fp32 state,
another summation order); fp16/bf16 inputs against the fp32 reference on the same rounded inputs:
the kernel rounds the output once and, on the GPU, multiplies the fp32 state in tf32, so 1e-2
(fp16) and 2e-2 (bf16: 8-bit mantissa output).
"""
import pytest
import torch

from llmaccel.ops.sla import sla_forward

kern = pytest.importorskip("llmaccel.kernels.sla")
if not kern.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)
INTERPRETED = type(kern._linear_attention_kernel).__name__ == "InterpretedFunction"
cpu_kernels = pytest.mark.skipif(not INTERPRETED, reason="kernels were imported without TRITON_INTERPRET=1")


def _inputs(B, T, H, Hkv, D, K, rows, dtype, device="cpu"):
    q = torch.randn(B, T, H * D, device=device).to(dtype)
    k = torch.randn(B, T, Hkv * D, device=device).to(dtype)
    v = torch.randn(B, T, Hkv * D, device=device).to(dtype)
    w = (0.3 * torch.randn((H if rows == "q" else Hkv) * D, K, device=device)).to(dtype)
    kw = dict(n_heads=H, n_kv_heads=Hkv, head_dim=D, kernel_size=K, eps=1e-6)
    return q, k, v, w, kw


def _check(out, q, k, v, w, kw, rel):
    exp = sla_forward(q.float(), k.float(), v.float(), w.float(), **kw)[0]
    assert out.shape == exp.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), exp, rtol=0, atol=rel * exp.abs().max().item())


@cpu_kernels
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize("B,T,H,Hkv,D,K,rows", [(2, 37, 4, 2, 16, 4, "q"), (1, 40, 3, 1, 24, 3, "kv"),
                                                (1, 5, 2, 2, 16, 1, "q")])
def test_kernel_matches_reference(dtype, rel, B, T, H, Hkv, D, K, rows):
    q, k, v, w, kw = _inputs(B, T, H, Hkv, D, K, rows, dtype)
    out = kern.linear_attention_triton(q, k, v, w, chunk=16, block_dv=16, **kw)
    _check(out, q, k, v, w, kw, rel)


@cpu_kernels
def test_custom_op_cpu_is_the_reference():
    q, k, v, w, kw = _inputs(1, 12, 2, 1, 16, 4, "q", torch.float32)
    torch.testing.assert_close(torch.ops.llmaccel.linear_attention(q, k, v, w, **kw),
                               sla_forward(q, k, v, w, **kw)[0], rtol=0, atol=0)


def test_fake_tensor_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        out = torch.ops.llmaccel.linear_attention(torch.empty(2, 7, 64), torch.empty(2, 7, 32),
                                                  torch.empty(2, 7, 32), torch.empty(64, 4),
                                                  n_heads=4, n_kv_heads=2, head_dim=16,
                                                  kernel_size=4, eps=1e-6)
    assert out.shape == (2, 7, 64)


def test_shape_errors():
    q, k, v, w, kw = _inputs(1, 4, 2, 1, 16, 4, "q", torch.float32)
    with pytest.raises(ValueError, match="conv_weight"):
        kern.linear_attention_triton(q, k, v, w[:, :3], **kw)
    with pytest.raises(ValueError, match="do not match"):
        kern.linear_attention_triton(q, k[..., :8], v, w, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 2e-2), (torch.float16, 1e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("H,Hkv", [(9, 3), (32, 8)])  # SmolLM2-135M, Llama-1B
@pytest.mark.parametrize("B,T", [(1, 512), (2, 2048)])
def test_cuda_custom_op(dtype, rel, H, Hkv, B, T):
    q, k, v, w, kw = _inputs(B, T, H, Hkv, 64, 4, "q", dtype, "cuda")
    out = torch.ops.llmaccel.linear_attention(q, k, v, w, **kw)
    _check(out, q, k, v, w, kw, rel)
