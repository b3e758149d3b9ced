"""The fused decode GEMV against its reference, and the reference against the unfused ops.

CPU: the Triton interpreter (TRITON_INTERPRET=1) at small shapes, fp32 and fp16, with every
combination of the fusions (norm prologue, glu, bias, residual), one tile and K-chunked, one and
several rows. Tolerance: fp32 1e-4 relative to the largest |output| (summation order over K up to
1,000); fp16 / bf16 one rounding of the output plus the order of an fp32 sum: 1e-2.
GPU: real shapes of llama-1b, SmolLM2 and llama2-7b in bf16, with programmatic dependent launch
inside a CUDA graph (a chain of GEMVs where each reads the previous one's output).
gemv_int4 likewise, against its reference on the dequantized fp32 weight (the same codes, scales
and zero points), with group sizes 16-128, a zero-padded last group and the looped-groups path.
"""
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmaccel import ops  # noqa: E402
from llmaccel.ops import quant as qops  # noqa: E402

gv = pytest.importorskip("llmaccel.kernels.gemv")
INTERPRETED = gv.triton is not None and type(gv._gemv_kernel).__name__ == "InterpretedFunction"


def case(M, N, K, dtype, *, glu=False, bias=False, residual=False, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + M * 7 + N * 13 + K)
    x = torch.randn(M, 1, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    b = (0.1 * torch.randn(N, generator=g)).to(device, dtype) if bias else None
    n_out = N // 2 if glu else N
    r = torch.randn(M, 1, n_out, generator=g).to(device, dtype) if residual else None
    return x, w, b, r


def check(out, ref, dtype):
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


def unfused(x, w, b, r, eps, glu):
    """The same computation as the IR ops it replaces, in fp32."""
    x, w = x.float(), w.float()
    b = b.float() if b is not None else None
    h = ops.rms_norm(x, None, eps=eps) if eps is not None else x
    y = ops.linear(h, w, b)
    if glu:
        y = ops.silu_mul(*y.chunk(2, dim=-1))
    return y + r.float() if r is not None else y


@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True), (False, True)])
def test_reference_matches_the_unfused_ops(eps, glu, bias, residual):
    x, w, b, r = case(3, 24, 40, torch.float32, glu=glu, bias=bias, residual=residual)
    ref = gv.gemv_ref(x, w, b, r, eps=eps, glu=glu)
    assert torch.allclose(ref, unfused(x, w, b, r, eps, glu), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("M,N,K", [(1, 48, 64), (2, 40, 100), (1, 7, 33)])
@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_interpreter(M, N, K, eps, glu, bias, residual, dtype):
    if glu and N % 2:
        N += 1
    x, w, b, r = case(M, N, K, dtype, glu=glu, bias=bias, residual=residual)
    ref = gv.gemv_ref(x, w, b, r, eps=eps, glu=glu)
    check(gv.gemv_triton(x, w, b, r, eps=eps, glu=glu), ref, dtype)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("glu,eps", [(False, None), (True, 1e-5)])
def test_gemv_interpreter_k_chunks(glu, eps, monkeypatch):
    """K past MAX_BLOCK_K: the program loops over K (no prefetch), same values."""
    monkeypatch.setattr(gv, "MAX_BLOCK_K", 32)
    x, w, b, r = case(2, 12, 100, torch.float32, glu=glu, bias=True, residual=True)
    assert gv.gemv_config(6 if glu else 12, 100, glu)[1] == 32
    check(gv.gemv_triton(x, w, b, r, eps=eps, glu=glu), gv.gemv_ref(x, w, b, r, eps=eps, glu=glu),
          torch.float32)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("glu,eps,bias", [(False, None, False), (True, 1e-5, True), (False, 1e-5, True)])
def test_gemv_interpreter_persistent(glu, eps, bias):
    """Persistent programs (fewer than the row tiles): each walks its tiles, loading the next
    ahead; same values."""
    x, w, b, r = case(2, 42, 64, torch.float32, glu=glu, bias=bias, residual=True)
    ref = gv.gemv_ref(x, w, b, r, eps=eps, glu=glu)
    for programs in (1, 3):  # 42 rows in tiles of 4 (2 with glu): a partial last tile
        check(gv.gemv_triton(x, w, b, r, eps=eps, glu=glu, elems=256, programs=programs), ref,
              torch.float32)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
def test_gemv_interpreter_strided_input():
    """A view with a row stride (a slice of a wider buffer) is read in place."""
    x, w, _, _ = case(3, 16, 32, torch.float32)
    wide = torch.randn(3, 1, 80)
    wide[..., 8:40] = x
    view = wide[..., 8:40]
    check(gv.gemv_triton(view, w), gv.gemv_ref(x, w), torch.float32)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
def test_gemv_interpreter_strided_bias():
    x, w, _, r = case(1, 16, 32, torch.float32, residual=True)
    b = torch.randn(32)[::2]  # a view with stride 2
    check(gv.gemv_triton(x, w, b, r), gv.gemv_ref(x, w, b, r), torch.float32)


def test_custom_op_on_cpu_and_shape_errors():
    x, w, b, r = case(2, 16, 24, torch.float32, glu=True, bias=True, residual=True)
    out = torch.ops.llmaccel.gemv(x, w, b, r, eps=1e-6, glu=True)
    assert torch.allclose(out, gv.gemv_ref(x, w, b, r, eps=1e-6, glu=True))
    with pytest.raises(ValueError, match="disagree"):
        torch.ops.llmaccel.gemv(x, w[:, :-1])
    with pytest.raises(ValueError, match="even"):
        torch.ops.llmaccel.gemv(x, w[:-1], glu=True)
    with pytest.raises(ValueError, match="residual"):
        torch.ops.llmaccel.gemv(x, w, residual=r)  # 16 outputs without glu, residual of 8


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 1, 64)
        w = torch.empty(96, 64)
        assert torch.ops.llmaccel.gemv(x, w, glu=True).shape == (4, 1, 48)
        assert torch.ops.llmaccel.gemv(x, w).shape == (4, 1, 96)


SHAPES = [(3072, 2048, False), (2048, 2048, False), (16384, 2048, True), (2048, 8192, False),
          (960, 576, False), (3072, 576, True), (576, 1536, False),
          (12288, 4096, False), (22016, 4096, True), (4096, 11008, False), (8, 20000, False)]


@pytest.mark.cuda
@pytest.mark.parametrize("N,K,glu", SHAPES)
@pytest.mark.parametrize("eps,bias,residual", [(None, False, False), (1e-5, False, False),
                                               (None, True, True), (1e-5, False, True)])
def test_gemv_cuda(N, K, glu, eps, bias, residual):
    x, w, b, r = case(1, N, K, torch.bfloat16, glu=glu, bias=bias, residual=residual, device="cuda")
    ref = gv.gemv_ref(x, w, b, r, eps=eps, glu=glu)
    check(torch.ops.llmaccel.gemv(x, w, b, r, eps=eps, glu=glu), ref, torch.bfloat16)
    check(gv.gemv_triton(x, w, b, r, eps=eps, glu=glu, pdl=False), ref, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("N,K,glu", SHAPES[:8])
def test_gemv_cuda_persistent(N, K, glu):
    x, w, b, r = case(1, N, K, torch.bfloat16, glu=glu, bias=True, residual=True, device="cuda")
    ref = gv.gemv_ref(x, w, b, r, eps=1e-5, glu=glu)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    for pps in (1, 4):
        check(gv.gemv_triton(x, w, b, r, eps=1e-5, glu=glu, programs=pps * n_sm), ref, torch.bfloat16)


@pytest.mark.cuda
def test_gemv_cuda_several_rows_and_fp32():
    x, w, b, r = case(5, 640, 1000, torch.float32, glu=True, bias=True, residual=True, device="cuda")
    check(gv.gemv_triton(x, w, b, r, eps=1e-6, glu=True), gv.gemv_ref(x, w, b, r, eps=1e-6, glu=True),
          torch.float32)


def check_chain_in_a_cuda_graph(layers, op, ref, H):
    """Layers of (qkv, o, gate/up, down) weights as a chain of fused GEMVs (norm, residual,
    SiLU-mul inside), each reading the one before, captured in a CUDA graph with `op` (PDL where
    the GPU has it) and replayed on new inputs: the `ref` chain's values within 3e-2 of its
    largest output."""
    def chain(h, fn):
        for wq, wo, wgu, wd in layers:
            a = fn(h, wq, eps=1e-5)
            h = fn(a, wo, residual=h)
            m = fn(h, wgu, eps=1e-5, glu=True)
            h = fn(m, wd, residual=h)
        return h

    x = torch.randn(1, 1, H, device="cuda").bfloat16()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(x, op)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(x, op)
    for seed in range(3):
        x.copy_(torch.randn(1, 1, H, generator=torch.Generator().manual_seed(seed)).cuda().bfloat16())
        g.replay()
        torch.cuda.synchronize()
        want = chain(x, ref)
        err = (out.float() - want.float()).abs().max().item()
        assert err <= 3e-2 * want.float().abs().max().item(), err


@pytest.mark.cuda
def test_gemv_chain_in_a_cuda_graph():
    """Four layers of qkv-, o-, gate/up- and down-shaped GEMVs in a replayed CUDA graph: the
    reference chain's values."""
    torch.manual_seed(0)
    H, I = 1024, 2048
    layers = [[(torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16() for n, k in
               ((H, H), (H, H), (2 * I, H), (H, I))] for _ in range(4)]

    def ref(x, w, residual=None, eps=None, glu=False):
        return gv.gemv_ref(x, w, None, residual, eps=eps, glu=glu)

    def op(x, w, residual=None, eps=None, glu=False):
        return torch.ops.llmaccel.gemv(x, w, None, residual, eps=eps, glu=glu)

    check_chain_in_a_cuda_graph(layers, op, ref, H)


# --- gemv_int4 -------------------------------------------------------------------------------

def case_int4(M, N, K, gs, dtype, *, glu=False, bias=False, residual=False, device="cpu", seed=0):
    """x and linear_int4's stored weights (random codes, zero points and positive scales)."""
    g = torch.Generator().manual_seed(seed + M * 7 + N * 13 + K + gs)
    G = -(-K // gs)
    q = torch.randint(0, 16, (N, G, gs), generator=g)
    z = torch.randint(0, 16, (N, G), generator=g)
    s = (torch.rand(N, G, generator=g) + 0.5) * (2.0 / (15 * K ** 0.5))
    x = torch.randn(M, 1, K, generator=g).to(device, dtype)
    b = (0.1 * torch.randn(N, generator=g)).to(device, dtype) if bias else None
    r = torch.randn(M, 1, N // 2 if glu else N, generator=g).to(device, dtype) if residual else None
    w = (qops.pack_int4(q).to(device), s.to(device, dtype), qops.pack_zeros(z).to(device))
    return x, w, b, r


def unfused_int4(x, w, gs, b, r, eps, glu):
    """The IR ops the int4 GEMV replaces (linear_int4's reference), in fp32."""
    x = x.float()
    b = b.float() if b is not None else None
    h = ops.rms_norm(x, None, eps=eps) if eps is not None else x
    y = qops.linear_int4(h, w[0], w[1].float(), w[2], b, group_size=gs)
    if glu:
        y = ops.silu_mul(*y.chunk(2, dim=-1))
    return y + r.float() if r is not None else y


@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("K,gs", [(64, 32), (100, 32)])
def test_int4_reference_matches_the_unfused_ops(eps, glu, K, gs):
    x, w, b, r = case_int4(3, 24, K, gs, torch.float32, glu=glu, bias=True, residual=True)
    ref = gv.gemv_int4_ref(x, *w, b, r, group_size=gs, eps=eps, glu=glu)
    assert torch.allclose(ref, unfused_int4(x, w, gs, b, r, eps, glu), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("M,N,K,gs", [(1, 48, 64, 32), (2, 40, 100, 32), (1, 7, 256, 64), (1, 6, 48, 16)])
@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_int4_interpreter(M, N, K, gs, eps, glu, bias, residual, dtype):
    if glu and N % 2:
        N += 1
    x, w, b, r = case_int4(M, N, K, gs, dtype, glu=glu, bias=bias, residual=residual)
    ref = gv.gemv_int4_ref(x, *w, b, r, group_size=gs, eps=eps, glu=glu)
    check(gv.gemv_int4_triton(x, *w, b, r, group_size=gs, eps=eps, glu=glu), ref, dtype)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("glu,eps", [(False, None), (True, 1e-5)])
def test_gemv_int4_interpreter_looped_groups(glu, eps, monkeypatch):
    """More words per row than MAX_WORDS_ROW: the program loops over groups, same values."""
    monkeypatch.setattr(gv, "MAX_WORDS_ROW", 4)
    x, w, b, r = case_int4(2, 12, 100, 32, torch.float32, glu=glu, bias=True, residual=True)
    assert gv.gemv_int4_config(6 if glu else 12, 4, 32, glu)[1] == 1
    check(gv.gemv_int4_triton(x, *w, b, r, group_size=32, eps=eps, glu=glu),
          gv.gemv_int4_ref(x, *w, b, r, group_size=32, eps=eps, glu=glu), torch.float32)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("glu,eps,chunked", [(False, None, False), (True, 1e-5, False),
                                             (False, 1e-5, True), (True, None, True)])
def test_gemv_int4_interpreter_tiles_per_program(glu, eps, chunked, monkeypatch):
    """More row tiles than programs (a partial last one), one chunk of groups or several:
    each program walks its tiles, loading the next ahead; same values."""
    if chunked:
        monkeypatch.setattr(gv, "MAX_WORDS_ROW", 4)
    x, w, b, r = case_int4(2, 26, 100, 32, torch.float32, glu=glu, bias=True, residual=True)
    ref = gv.gemv_int4_ref(x, *w, b, r, group_size=32, eps=eps, glu=glu)
    for programs in (1, 2, 0):
        check(gv.gemv_int4_triton(x, *w, b, r, group_size=32, eps=eps, glu=glu, words=16,
                                  programs=programs), ref, torch.float32)


def test_int4_custom_op_on_cpu_and_shape_errors():
    x, w, b, r = case_int4(2, 16, 60, 16, torch.float32, glu=True, bias=True, residual=True)
    out = torch.ops.llmaccel.gemv_int4(x, *w, b, r, group_size=16, eps=1e-6, glu=True)
    assert torch.allclose(out, gv.gemv_int4_ref(x, *w, b, r, group_size=16, eps=1e-6, glu=True))
    with pytest.raises(ValueError, match="power of two"):
        torch.ops.llmaccel.gemv_int4(x, *w, group_size=32)
    with pytest.raises(ValueError, match="groups"):
        torch.ops.llmaccel.gemv_int4(x[..., :40], *w, group_size=16)
    with pytest.raises(ValueError, match="scales"):
        torch.ops.llmaccel.gemv_int4(x, w[0], w[1][:, :2], w[2], group_size=16)
    with pytest.raises(ValueError, match="residual"):
        torch.ops.llmaccel.gemv_int4(x, *w, residual=r, group_size=16)


def test_int4_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(1, 1, 256)
        qw = torch.empty(96, 2, 64, dtype=torch.uint8)
        s, z = torch.empty(96, 2), torch.empty(96, 1, dtype=torch.uint8)
        assert torch.ops.llmaccel.gemv_int4(x, qw, s, z, group_size=128, glu=True).shape == (1, 1, 48)


INT4_SHAPES = [(3072, 2048, False), (2048, 2048, False), (16384, 2048, True), (2048, 8192, False),
               (128256, 2048, False), (960, 576, False), (3072, 576, True), (576, 1536, False),
               (12288, 4096, False), (22016, 4096, True), (4096, 11008, False), (8, 40000, False)]


@pytest.mark.cuda
@pytest.mark.parametrize("N,K,glu", INT4_SHAPES)
@pytest.mark.parametrize("eps,bias,residual", [(None, False, False), (1e-5, False, False),
                                               (None, True, True), (1e-5, False, True)])
def test_gemv_int4_cuda(N, K, glu, eps, bias, residual):
    gs = 64 if K == 576 else 128
    x, w, b, r = case_int4(1, N, K, gs, torch.bfloat16, glu=glu, bias=bias, residual=residual,
                           device="cuda")
    ref = gv.gemv_int4_ref(x, *w, b, r, group_size=gs, eps=eps, glu=glu)
    check(torch.ops.llmaccel.gemv_int4(x, *w, b, r, group_size=gs, eps=eps, glu=glu), ref,
          torch.bfloat16)
    check(gv.gemv_int4_triton(x, *w, b, r, group_size=gs, eps=eps, glu=glu, pdl=False), ref,
          torch.bfloat16)


@pytest.mark.cuda
def test_gemv_int4_chain_in_a_cuda_graph():
    """gemv_int4 layers (qkv-, o-, gate/up-, down-shaped) in a replayed CUDA graph: the
    reference chain's values."""
    H, I, gs = 1024, 2048, 128
    layers = [[case_int4(1, n, k, gs, torch.bfloat16, device="cuda", seed=10 * i + j)[1]
               for j, (n, k) in enumerate(((H, H), (H, H), (2 * I, H), (H, I)))] for i in range(4)]

    def ref(x, w, residual=None, eps=None, glu=False):
        return gv.gemv_int4_ref(x, *w, None, residual, group_size=gs, eps=eps, glu=glu)

    def op(x, w, residual=None, eps=None, glu=False):
        return torch.ops.llmaccel.gemv_int4(x, *w, None, residual, group_size=gs, eps=eps, glu=glu)

    check_chain_in_a_cuda_graph(layers, op, ref, H)
