"""RoPE on tables and SiLU-mul kernels (the eager steps') against their references.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small shapes, fp32 and fp16 (the interpreter
rounds float to bf16 toward zero, so bf16 is checked on the GPU only), strided
views of a fused projection, positions of one row or of several. GPU (@cuda): llama-1b's shapes
in bf16 and fp32 through the custom ops. Tolerances: RoPE rounds each product and the sum as
the reference does, so it is equal (fp16/bf16) or within fp32 rounding; SiLU-mul within one
rounding step of the output dtype (exp of another implementation under the interpreter).
"""
import pytest
import torch

from llmaccel import ops
from llmaccel.codegen.lower import rope_tables
from llmaccel.ops.rope import rope_table

kern = pytest.importorskip("llmaccel.kernels.pointwise")
if kern.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)
INTERPRETED = type(kern._rope_kernel).__name__ == "InterpretedFunction"
cpu_kernels = pytest.mark.skipif(not INTERPRETED, reason="kernels were imported without TRITON_INTERPRET=1")
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


def _rope_inputs(B, T, H, Hkv, D, dtype, device, max_len=64):
    """A fused projection (B, T, (H + 2 Hkv) D) and its q and k views; tables; positions."""
    qkv = (torch.randn(B, T, (H + 2 * Hkv) * D) * 2).to(dtype).to(device)
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    cos, sin = rope_tables(D, 10000.0, None, max_len, device)
    pos = torch.randint(0, max_len, (B, T), device=device)
    return q, k, cos, sin, pos


@cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 7, 4, 2, 16), (2, 5, 3, 1, 8), (1, 9, 6, 6, 10)])
def test_rope_kernel_matches_reference(dtype, shape):
    B, T, H, Hkv, D = shape
    q, k, cos, sin, pos = _rope_inputs(B, T, H, Hkv, D, dtype, "cpu")
    for x in (q, k, q.contiguous()):
        out = kern.rope_table_triton(x, cos, sin, pos, D)
        exp = rope_table(x, cos, sin, pos, head_dim=D)
        assert out.shape == exp.shape and out.dtype == exp.dtype and out.is_contiguous()
        torch.testing.assert_close(out, exp, **TOL[dtype])
    one = pos[:1]  # positions of one row shared by every batch row
    torch.testing.assert_close(kern.rope_table_triton(q, cos, sin, one, D),
                               rope_table(q, cos, sin, one.expand(B, T), head_dim=D), **TOL[dtype])


@cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 6, 48), (3, 5, 100), (9, 40)])
def test_silu_mul_kernel_matches_reference(dtype, shape):
    gu = (torch.randn(*shape[:-1], 2 * shape[-1]) * 3).to(dtype)
    gate, up = gu.chunk(2, dim=-1)  # the halves of a fused gate/up projection, read in place
    out = kern.silu_mul_triton(gate, up)
    exp = ops.silu_mul(gate, up)
    assert out.shape == exp.shape and out.dtype == exp.dtype
    torch.testing.assert_close(out, exp, **TOL[dtype])
    torch.testing.assert_close(kern.silu_mul_triton(gate.contiguous(), up), exp, **TOL[dtype])


def test_shapes_that_are_not_whole_heads_are_refused():
    x = torch.randn(1, 3, 20)
    cos, sin = rope_tables(8, 10000.0, None, 16, "cpu")
    with pytest.raises(ValueError, match="whole heads"):
        kern.rope_table_triton(x, cos, sin, torch.zeros(1, 3, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="differ"):
        kern.silu_mul_triton(torch.randn(2, 4), torch.randn(2, 5))


def test_cpu_ops_are_the_reference():
    q, k, cos, sin, pos = _rope_inputs(2, 3, 4, 2, 8, torch.float32, "cpu")
    assert torch.equal(torch.ops.llmaccel.rope_table(q, cos, sin, pos, head_dim=8),
                       rope_table(q, cos, sin, pos, head_dim=8))
    g, u = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    assert torch.equal(torch.ops.llmaccel.silu_mul(g, u), ops.silu_mul(g, u))


def test_only_eager_lowering_maps_silu_mul():
    from llmaccel.codegen.lower import lower
    from llmaccel.compiler.model import load
    m = load("preset:tiny-llama", dtype=torch.float32, device="cpu")
    for select in ("all", "eager"):
        gm, rep = lower(m.gm, max_len=64, select=select)
        assert any(n.op == "call_function" and n.target is ops.silu_mul for n in gm.graph.nodes)
        assert ("silu_mul" in rep.cpu_traced) == (select == "eager")  # the CPU keeps the reference
        assert "rope_table" not in rep.custom  # on the CPU the reference rotation stays too


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_ops_match_reference(dtype):
    q, k, cos, sin, pos = _rope_inputs(1, 4096, 32, 8, 64, dtype, "cuda", max_len=8192)
    for x in (q, k):
        torch.testing.assert_close(torch.ops.llmaccel.rope_table(x, cos, sin, pos, head_dim=64),
                                   rope_table(x, cos, sin, pos, head_dim=64), **TOL[dtype])
    gate, up = (torch.randn(1, 4096, 2 * 8192, device="cuda") * 3).to(dtype).chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.llmaccel.silu_mul(gate, up), ops.silu_mul(gate, up),
                               **TOL[dtype])


@pytest.mark.cuda
def test_eager_lowering_on_gpu_maps_rope_and_silu_mul():
    from llmaccel.codegen.lower import lower
    from llmaccel.compiler.model import load
    m = load("preset:tiny-llama", dtype=torch.float32, device="cuda")
    _, rep = lower(m.gm, max_len=64, select="eager")
    assert rep.custom.get("rope_table", 0) == 2 * m.config.n_layers and rep.custom.get("silu_mul")
    _, rep = lower(m.gm, max_len=64, select="all")
    assert "rope_table" not in rep.custom and "silu_mul" not in rep.custom
