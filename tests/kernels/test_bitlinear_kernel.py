"""BitLinear Triton kernel (RMSNorm + int8 activation quantization + ternary matmul) against the
reference ops in llmaccel/ops/bitlinear.py.

Tolerances. The int8 x ternary products accumulate exactly in int32 and the epilogue repeats the
reference's fp32 operations, so:
- plain bitlinear, fp32 input, interpreter: bit-identical (the activation codes, the integer sums
  and the epilogue are all order-free);
- fused rms_norm_bitlinear: the sum of squares is added in a different order, so rstd may differ
  in the last bit and a code sitting on a rounding boundary may flip; each flip moves an output
  by at most w_scale / inv. Allowed: at most `FLIPS` codes' worth per output
  (|diff| <= FLIPS * max(w_scale) / inv + fp32 rounding);
- fp16 / bf16 output: the same bound plus one rounding of the output (2^-8 relative for bf16).
- split-K: fp32 partial sums added atomically: fp32 rounding of the output (1e-6 relative).
CPU runs the interpreter (TRITON_INTERPRET=1) at small shapes with fp32/fp16 inputs; GPU tests
run the compiled kernel at SmolLM2 / Llama-1B shapes in fp32 and bf16.
"""
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from llmaccel.ops import bitlinear as bo  # noqa: E402

kb_mod = pytest.importorskip("llmaccel.kernels.bitlinear")
INTERPRETED = kb_mod.triton is not None and \
    type(kb_mod._bitlinear_kernel).__name__ == "InterpretedFunction"
FLIPS = 2


@pytest.fixture(scope="module")
def kb():
    if not INTERPRETED:
        pytest.skip("triton missing, or kernels imported without TRITON_INTERPRET=1")
    return kb_mod


def make(M, N, K, dtype=torch.float32, device="cpu", bias=True, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = torch.randint(-1, 2, (N, K), generator=g)
    s = torch.rand(N, generator=g) * 0.02 + 0.01
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
    x[:, 0] += 8.0                                         # an outlier channel, as in real models
    nw = torch.rand(K, generator=g) + 0.5
    b = torch.randn(N, generator=g) if bias else None
    to = dict(device=device)
    return (x.to(dtype=dtype, **to), bo.pack_ternary(t).to(**to), s.to(dtype=dtype, **to),
            None if b is None else b.to(dtype=dtype, **to), nw.to(dtype=dtype, **to))


def flip_bound(x, s, fused, eps=1e-6, nw=None):
    h = bo.rms_norm(x, nw, eps=eps) if fused else x
    amax = h.float().abs().amax(-1, keepdim=True).clamp_min(1e-5)
    return FLIPS * s.float().max() * amax / 127


def check(out, ref, x, s, dtype, fused, nw=None):
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    if dtype == torch.float32 and not fused:
        assert torch.equal(out, ref), diff.max().item()
        return
    bound = flip_bound(x, s, fused, nw=nw) if fused else 0.0
    rnd = 1e-6 if dtype == torch.float32 else (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
    assert (diff <= bound + rnd * ref.float().abs() + 1e-6).all(), diff.max().item()
    # flips are rare: almost every output is exact up to the output rounding
    assert (diff <= rnd * ref.float().abs() + 1e-6).float().mean() > 0.9


SHAPES = [(1, 48, 128), (3, 40, 200), (16, 32, 64), (20, 36, 160), (33, 65, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_bitlinear_interpreter(kb, M, N, K, dtype):
    x, p, s, b, _ = make(M, N, K, dtype)
    out = kb.bitlinear_triton(x, p, s, b, in_features=K, out_features=N)
    ref = bo.bitlinear(x, p, s, b, in_features=K, out_features=N)
    check(out, ref, x, s, dtype, fused=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", SHAPES[:4])
def test_rms_norm_bitlinear_interpreter(kb, M, N, K, dtype):
    x, p, s, b, nw = make(M, N, K, dtype)
    out = kb.bitlinear_triton(x, p, s, b, in_features=K, out_features=N, norm_weight=nw, eps=1e-6)
    ref = bo.rms_norm_bitlinear(x, nw, p, s, b, eps=1e-6, in_features=K, out_features=N)
    check(out, ref, x, s, dtype, fused=True, nw=nw)


def test_norm_without_weight_and_leading_dims(kb):
    x, p, s, _, _ = make(6, 24, 96, bias=False)
    x3 = x.view(2, 3, 96)
    out = kb.bitlinear_triton(x3, p, s, None, in_features=96, out_features=24, eps=1e-5)
    ref = bo.rms_norm_bitlinear(x3, None, p, s, None, eps=1e-5, in_features=96, out_features=24)
    assert out.shape == (2, 3, 24)
    check(out, ref, x3, s, torch.float32, fused=True)


def test_split_k_interpreter(kb):
    x, p, s, b, nw = make(2, 20, 512)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=4, num_warps=4)
    out = kb.bitlinear_triton(x, p, s, b, in_features=512, out_features=20, config=cfg)
    ref = bo.bitlinear(x, p, s, b, in_features=512, out_features=20)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("fused", [False, True])
def test_gemv_chunks_and_ragged_rows(kb, M, fused):
    """The decode GEMV (M <= GEMV_ROWS) over K in several chunks (BLOCK_W = 4 words: 64
    columns a chunk), a ragged last row tile and K not a multiple of 64, on fresh inputs."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    x, p, s, b, nw = make(M, 37, 300, seed=seed)
    cfg = dict(BLOCK_N=8, BLOCK_W=4, num_warps=4)
    if fused:
        out = kb.bitlinear_triton(x, p, s, b, in_features=300, out_features=37, norm_weight=nw,
                                  eps=1e-6, config=cfg)
        ref = bo.rms_norm_bitlinear(x, nw, p, s, b, eps=1e-6, in_features=300, out_features=37)
    else:
        out = kb.bitlinear_triton(x, p, s, b, in_features=300, out_features=37, config=cfg)
        ref = bo.bitlinear(x, p, s, b, in_features=300, out_features=37)
    check(out, ref, x, s, torch.float32, fused=fused, nw=nw if fused else None)


def test_gemv_config_fills_the_gpu():
    from llmaccel.kernels.bitlinear_gemv import MAX_BLOCK_W, gemv_config
    for K, N in [(2048, 2048), (2048, 3072), (8192, 2048), (11008, 4096), (576, 960)]:
        cfg = gemv_config(1, N, K, 132)
        assert cfg["BLOCK_W"] <= MAX_BLOCK_W and cfg["BLOCK_W"] & (cfg["BLOCK_W"] - 1) == 0
        assert -(-N // cfg["BLOCK_N"]) >= 2 * 132 or cfg["BLOCK_N"] == 1


def test_custom_ops_on_cpu_are_the_reference(kb):
    x, p, s, b, nw = make(3, 16, 64)
    torch.testing.assert_close(torch.ops.llmaccel.bitlinear(x, p, s, b, in_features=64, out_features=16),
                               bo.bitlinear(x, p, s, b, in_features=64, out_features=16), rtol=0, atol=0)
    torch.testing.assert_close(
        torch.ops.llmaccel.rms_norm_bitlinear(x, nw, p, s, b, eps=1e-6, in_features=64, out_features=16),
        bo.rms_norm_bitlinear(x, nw, p, s, b, eps=1e-6, in_features=64, out_features=16), rtol=0, atol=0)


def test_shape_mismatch_is_rejected(kb):
    x, p, s, _, _ = make(1, 16, 64)
    with pytest.raises(ValueError, match="disagree"):
        kb.bitlinear_triton(x, p, s, in_features=64, out_features=17)


def test_lowering_maps_ir_ops_to_custom_ops():
    from llmaccel.codegen.lower import lower
    from llmaccel.compiler.model import load
    from llmaccel.compiler.registry import get_pass
    from llmaccel.passes.base import PassContext, Progress

    m = load("preset:tiny-llama")
    res = get_pass("bitlinear")().run(m.gm, PassContext(m.config, progress=Progress(False)))
    res.gm.recompile()
    low, rep = lower(res.gm, max_len=64)
    assert rep.custom.get("bitlinear") == 4 and rep.custom.get("rms_norm_bitlinear") == 4, rep
    ids = torch.randint(0, 512, (1, 7))
    pos = torch.arange(7)[None]
    torch.testing.assert_close(low(ids, pos, None), res.gm(ids, pos, None), rtol=0, atol=0)


# --- GPU, real shapes: SmolLM2-135M (576 x 1536) and Llama-3.2-1B (2048 x 8192) -------------------

GPU_SHAPES = [(576, 1536), (1536, 576), (2048, 8192), (8192, 2048), (11008, 4096)]   # (K, N)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("K,N", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_bitlinear_cuda(M, K, N, dtype, fused):
    x, p, s, b, nw = make(M, N, K, dtype, "cuda")
    if fused:
        out = torch.ops.llmaccel.rms_norm_bitlinear(x, nw, p, s, b, eps=1e-6, in_features=K, out_features=N)
        ref = bo.rms_norm_bitlinear(x.cpu(), nw.cpu(), p.cpu(), s.cpu(), b.cpu(), eps=1e-6,
                                    in_features=K, out_features=N)
    else:
        out = torch.ops.llmaccel.bitlinear(x, p, s, b, in_features=K, out_features=N)
        ref = bo.bitlinear(x.cpu(), p.cpu(), s.cpu(), b.cpu(), in_features=K, out_features=N)
    out = out.cpu()
    # On the GPU rsqrt, the division and the split-K atomics need not be IEEE-exact: allow flips
    # and fp32 rounding for every case.
    diff = (out.float() - ref.float()).abs()
    bound = flip_bound(x.cpu(), s.cpu(), fused, nw=nw.cpu() if fused else None)
    rnd = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert (diff <= bound + rnd * ref.float().abs() + 1e-5).all(), diff.max().item()
    assert (diff <= rnd * ref.float().abs() + 1e-5).float().mean() > 0.95
