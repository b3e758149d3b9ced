"""linear_int4 / linear_int8 Triton kernels against the reference ops.

CPU: the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported) at small shapes,
fp32 and fp16 inputs (the interpreter mishandles bf16 in tl.dot), every kernel variant through
explicit tile configs (odd N, K a multiple of the group or not, batch 1..16, split-K) and the
default configs. Reference: dequantize in fp32, then matmul in fp32. Tolerances, as a fraction of
the largest |output|: fp32 1e-4 (accumulation order); fp16/bf16 2e-2 (output rounding, and the
dot path's weights rounded to x's dtype as the reference's dequantize does). GPU tests run the
real kernels at Llama-3.2-1B shapes in bf16.
"""
import os

import torch  # importing torch alone does not import triton

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from llmaccel.ops import quant as qo  # noqa: E402

ql_mod = pytest.importorskip("llmaccel.kernels.quant_linear")
q8_mod = pytest.importorskip("llmaccel.kernels.quant_linear_int8")
INTERPRETED = ql_mod.triton is not None and \
    type(ql_mod._int4_gemv_kernel).__name__ == "InterpretedFunction"


@pytest.fixture(scope="module")
def ql():
    if not INTERPRETED:
        pytest.skip("triton missing, or kernels imported without TRITON_INTERPRET=1")
    return ql_mod


@pytest.fixture(scope="module")
def k8(ql):
    return q8_mod


def int4_weights(N, K, gs, dtype=torch.float32, device="cpu"):
    G = -(-K // gs)
    qw = torch.randint(0, 256, (N, G, gs // 2), dtype=torch.uint8, device=device)
    sc = (torch.rand(N, G, device=device) * 0.02 + 0.005).to(dtype)
    zr = torch.randint(0, 256, (N, -(-G // 2)), dtype=torch.uint8, device=device)
    return qw, sc, zr


def int8_weights(N, K, dtype=torch.float32, device="cpu"):
    q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=device)
    return q8, (torch.rand(N, device=device) * 0.01 + 0.001).to(dtype)


def close(out, ref, dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * ref.float().abs().max().item() + 1e-6, (err, ref.abs().max().item())


def check_int4(ql, M, N, K, gs, dtype, cfg, bias=True):
    qw, sc, zr = int4_weights(N, K, gs, dtype)
    x = torch.randn(M, K).to(dtype)
    b = torch.randn(N).to(dtype) if bias else None
    out = ql.linear_int4_triton(x, qw, sc, zr, b, group_size=gs, config=cfg)
    ref = qo.linear_int4(x.float(), qw, sc.float(), zr, None if b is None else b.float(), group_size=gs)
    assert out.dtype == dtype and out.shape == (M, N)
    close(out, ref, dtype)


GEMV4 = dict(kernel="gemv", BLOCK_N=8, BLOCK_G=2, SPLIT_K=1, num_warps=1)


@pytest.mark.parametrize("unpack", [0, 1])
@pytest.mark.parametrize("M,dtype", [(1, torch.float32), (1, torch.float16), (3, torch.float16),
                                     (16, torch.float32)])
def test_int4_gemv_interpreter(ql, M, dtype, unpack):
    check_int4(ql, M, 37, 128 if M > 4 else 256, 64, dtype, dict(GEMV4, UNPACK=unpack))


@pytest.mark.parametrize("K,gs,split,unpack", [(200, 64, 1, 0), (200, 64, 1, 1), (96, 32, 2, 0),
                                               (512, 128, 4, 1)])
def test_int4_gemv_padded_and_split_interpreter(ql, K, gs, split, unpack):
    # K = 200 with groups of 64: the last group is zero-padded; split-K adds fp32 partials
    check_int4(ql, 2, 21, K, gs, torch.float32, dict(GEMV4, BLOCK_G=1, UNPACK=unpack, SPLIT_K=split))


@pytest.mark.parametrize("M,K,gs,split,stages,dtype", [(1, 256, 64, 1, 1, torch.float32),
                                                      (1, 200, 64, 2, 3, torch.float32),
                                                      (1, 512, 64, 1, 3, torch.float16),
                                                      (3, 256, 64, 1, 1, torch.float32)])
def test_int4_gemv_unpack2_interpreter(ql, M, K, gs, split, stages, dtype):
    # UNPACK=2: zero point folded into the dequantizing FMA, one row (M > 1 runs UNPACK=1)
    cfg = dict(GEMV4, BLOCK_G=2, UNPACK=2, SPLIT_K=split, STAGES=stages)
    check_int4(ql, M, 21, K, gs, dtype, cfg)


@pytest.mark.parametrize("M,split,unpack", [(1, 2, 2), (3, 4, 1), (1, 3, 0)])
def test_int4_gemv_serial_split_interpreter(ql, M, split, unpack):
    # one-launch split-K: partials in a workspace, the last program of a tile sums them; the
    # counters must be back at zero after a call, so a second call on the same buffers agrees
    cfg = dict(GEMV4, BLOCK_G=1, UNPACK=unpack, SPLIT_K=split, SERIAL=True)
    for _ in range(2):
        check_int4(ql, M, 21, 256, 64, torch.float16, cfg)
    assert all(int(c.abs().sum()) == 0 for _, c in ql._WORKSPACES.values())


@pytest.mark.parametrize("M,K,gs,split,dtype", [(2, 256, 32, 1, torch.float16),
                                                (5, 200, 64, 2, torch.float32),
                                                (20, 256, 128, 1, torch.float32),
                                                (16, 256, 128, 1, torch.float16)])
def test_int4_dot_interpreter(ql, M, K, gs, split, dtype):
    cfg = dict(kernel="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_G=2, SPLIT_K=split, num_warps=4)
    check_int4(ql, M, 37, K, gs, dtype, cfg)


@pytest.mark.parametrize("M", [1, 4, 33, 64])
def test_int4_default_config_interpreter(ql, M):
    x = torch.randn(2, (M + 1) // 2, 128)                    # leading dims are flattened
    qw, sc, zr = int4_weights(20, 128, 64)
    out = ql.linear_int4_triton(x, qw, sc, zr, group_size=64)
    assert out.shape == (2, (M + 1) // 2, 20)
    close(out, qo.linear_int4(x, qw, sc, zr, group_size=64), torch.float32)


def test_prefill_rows_take_prefill_tiles_not_the_decode_sweeps():
    # the tables hold decode batches (1-64 rows); 128 prompt rows through 16-row tiles took an
    # int4 llama-1b prefill's TTFT to ~4 ms against ~3.1 with 128-row tiles
    for K, N in GPU_SHAPES:
        for M in (65, 128, 1024):
            c4 = ql_mod.int4_config(M, N, K, 128, 132, asm=True, device="NVIDIA H200")
            c8 = ql_mod.int8_config(M, N, K, 132, "NVIDIA H200")
            assert c4 == ql_mod.int4_config(M, N, K, 128, 132, asm=True) and c4["kernel"] == "dot"
            assert c8 == ql_mod.int8_config(M, N, K, 132) and c8["kernel"] == "dot"
            assert c4["BLOCK_M"] == 128 and c4["SPLIT_K"] == 1
        assert ql_mod.int4_config(16, N, K, 128, 132, asm=True, device="NVIDIA H200") == \
            ql_mod.TUNED["NVIDIA H200"][("int4", N, K, 128, 16)]


def test_decode_batches_of_17_to_64_rows_take_the_measured_tiles():
    # int4: the prefill's tensor-core tiles, asm or not (64-row dotasm tiles with split-K decoded
    # at half their speed at 64 requests on the H100); int8: N tiles narrowed until the tiles
    # cover the SMs (llama-1b's o at 64 rows: 32 programs of 64 x 64 on 132 SMs before)
    for K, N in GPU_SHAPES:
        for M in (17, 48, 64):
            for asm in (True, False):
                c = ql_mod.int4_config(M, N, K, 128, 132, asm=asm)
                assert c["kernel"] == "dot" and c["BLOCK_M"] == (32 if M <= 32 else 64), (M, N, K, c)
                assert c.get("SPLIT_K", 1) == 1
            c8 = ql_mod.int8_config(M, N, K, 132)
            assert -(-N // c8["BLOCK_N"]) * -(-M // c8["BLOCK_M"]) >= 128 or c8["BLOCK_N"] == 16, (M, N, K, c8)


def test_int4_prefill_default_config_interpreter(ql):
    # 130 rows: a full 128-row tile and a ragged one
    x = torch.randn(130, 256)
    qw, sc, zr = int4_weights(70, 256, 128)
    close(ql.linear_int4_triton(x, qw, sc, zr, group_size=128), qo.linear_int4(x, qw, sc, zr, group_size=128),
          torch.float32)


GEMV8 = dict(kernel="gemv", BLOCK_N=8, BLOCK_W=16, SPLIT_K=1, num_warps=1)


INT8_CFGS = [dict(GEMV8, UNPACK=0), dict(GEMV8, UNPACK=1), dict(GEMV8, UNPACK=1, SPLIT_K=2), None,
             dict(kernel="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4)]


@pytest.mark.parametrize("i", range(len(INT8_CFGS)))
@pytest.mark.parametrize("M,K,dtype", [(1, 200, torch.float32), (3, 128, torch.float16),
                                       (16, 72, torch.float32)])
def test_int8_interpreter(k8, M, K, dtype, i):
    q8, s8 = int8_weights(37, K, dtype)
    x, b = torch.randn(M, K).to(dtype), torch.randn(37).to(dtype)
    out = k8.linear_int8_triton(x, q8, s8, b, config=INT8_CFGS[i])
    assert out.dtype == dtype and out.shape == (M, 37)
    close(out, qo.linear_int8(x.float(), q8, s8.float(), b.float()), dtype)


def test_int8_k_not_multiple_of_4_falls_back_to_dot(k8):
    q8, s8 = int8_weights(9, 70)
    x = torch.randn(2, 70)
    close(k8.linear_int8_triton(x, q8, s8, config=GEMV8), qo.linear_int8(x, q8, s8), torch.float32)


def test_custom_ops_on_cpu_match_the_reference(ql):
    qw, sc, zr = int4_weights(8, 64, 32)
    x = torch.randn(3, 64)
    torch.testing.assert_close(torch.ops.llmaccel.linear_int4(x, qw, sc, zr, None, group_size=32),
                               qo.linear_int4(x, qw, sc, zr, group_size=32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 40, 64), (5, 96, 576), (2, 3, 7)])
def test_int8_cpu_kernel_matches_the_reference(M, N, K, dtype):
    # CPU int8 = aten's int8 weight-only GEMM: fp32 sums scaled once per row, x and the scales in
    # bf16 (cpu_act_dtype: fp32 x is rounded to bf16, 2^-9 relative each, so 2^-8 of the
    # output's magnitude); in bf16 the reference rounds the dequantized weight and the output to
    # bf16 (2^-8 relative each), so allow a few bf16 roundings of the output's magnitude.
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    q8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s8 = (torch.rand(N, generator=g) * 0.02 + 0.001).to(dtype)
    x = torch.randn(2, M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    out = torch.ops.llmaccel.linear_int8(x, q8, s8, b)
    want = qo.linear_int8(x.double(), q8, s8.double(), b.double())
    assert out.dtype == dtype and out.shape == (2, M, N)
    tol = 2 ** -8 if dtype == torch.float32 else 2 ** -6
    scale = (x.double().abs() @ (q8.double().abs() * s8.double()[:, None]).T).amax() + 1
    assert ((out.double() - want).abs() <= tol * scale).all()


def test_dotasm_needs_bf16_cuda(ql):
    qw, sc, zr = int4_weights(16, 128, 128)
    cfg = dict(kernel="dotasm", BLOCK_M=16, BLOCK_N=16, BLOCK_G=1, num_warps=4)
    with pytest.raises(ValueError, match="bf16 CUDA"):
        ql.linear_int4_triton(torch.randn(1, 128), qw, sc, zr, group_size=128, config=cfg)


def test_shape_mismatch_is_rejected(ql):
    qw, sc, zr = int4_weights(8, 64, 32)
    with pytest.raises(ValueError, match="disagree"):
        ql.linear_int4_triton(torch.randn(1, 96), qw, sc, zr, group_size=32)
    with pytest.raises(ValueError, match="GEMV"):
        ql.linear_int4_triton(torch.randn(17, 64), qw, sc, zr, group_size=32, config=GEMV4)


GPU_SHAPES = [(2048, 8192), (8192, 2048), (2048, 128256), (2048, 2048), (2048, 512)]   # (K, N)


def test_default_configs_are_launchable():
    # tile sizes must be powers of two and the dot path needs tiles of at least 16
    for K, N in GPU_SHAPES + [(576, 1536), (1536, 576)]:
        for M in (1, 2, 4, 9, 16, 17, 512):
            for cfg in (ql_mod.int4_config(M, N, K, 128, 132), ql_mod.int4_config(M, N, K, 128, 132, asm=True),
                        ql_mod.int4_config(M, N, K, 128, 132, asm=True, device="NVIDIA H200"),
                        ql_mod.int8_config(M, N, K, 132), ql_mod.int8_config(M, N, K, 132, "NVIDIA H200")):
                blocks = [v for k, v in cfg.items() if k.startswith("BLOCK")]
                assert all(b & (b - 1) == 0 for b in blocks), cfg
                assert cfg["kernel"] != "gemv" or M <= ql_mod.GEMV_MAX_M
                if cfg["kernel"] != "gemv":
                    assert cfg["BLOCK_M"] >= 16 and cfg["BLOCK_N"] >= 16, cfg


# --- GPU, real shapes (Llama-3.2-1B: hidden 2048, intermediate 8192, vocab 128256, k/v 512) -------

@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 2, 4, 16, 64, 512])
@pytest.mark.parametrize("K,N", GPU_SHAPES)
def test_int4_cuda(M, K, N):
    qw, sc, zr = int4_weights(N, K, 128, torch.bfloat16, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    out = torch.ops.llmaccel.linear_int4(x, qw, sc, zr, b, group_size=128)
    ref = qo.linear_int4(x.float(), qw, sc.float(), zr, b.float(), group_size=128)
    close(out, ref, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", [dict(kernel="gemv", BLOCK_N=8, BLOCK_G=8, UNPACK=u, SPLIT_K=s, num_warps=w)
                                 for u in (0, 1, 2) for s in (1, 4) for w in (1, 4)]
                         + [dict(kernel="gemv", BLOCK_N=bn, BLOCK_G=4, UNPACK=u, SPLIT_K=1, num_warps=w,
                                 STAGES=3) for bn, w in ((8, 1), (16, 4)) for u in (0, 1, 2)]
                         + [dict(kernel="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_G=g, SPLIT_K=s, num_warps=4,
                                 num_stages=3) for g in (1, 2) for s in (1, 2)]
                         + [dict(kernel="dotasm", BLOCK_M=16, BLOCK_N=bn, BLOCK_G=1, SPLIT_K=s, num_warps=w,
                                 num_stages=3, PREFETCH=pf)
                            for bn, w in ((128, 4), (64, 2)) for s in (1, 4) for pf in (False, True)]
                         + [dict(kernel="dotasm", BLOCK_M=16, BLOCK_N=bn, BLOCK_G=1, SPLIT_K=s, num_warps=w,
                                 num_stages=3, XPERM=xp) for bn, w in ((32, 1), (64, 2), (128, 4))
                            for s in (1, 4) for xp in (False, True)]
                         + [dict(kernel="dotasm", BLOCK_M=16, BLOCK_N=64, BLOCK_G=1, SPLIT_K=s, num_warps=2,
                                 num_stages=3, XPERM=True, SERIAL=True) for s in (2, 8)]
                         + [dict(kernel="dotasm", BLOCK_M=bm, BLOCK_N=64, BLOCK_G=1, SPLIT_K=s, num_warps=4,
                                 num_stages=3, XPERM=True, SERIAL=sr) for bm in (32, 64) for s, sr in
                            ((1, False), (4, False), (4, True))]
                         + [dict(kernel="gemv", BLOCK_N=8, BLOCK_G=4, UNPACK=u, SPLIT_K=s, num_warps=1,
                                 SERIAL=True) for u in (1, 2) for s in (2, 4)])
@pytest.mark.parametrize("M,K", [(1, 2048), (3, 2048), (2, 200), (40, 2048)])
def test_int4_variants_cuda(cfg, M, K):
    if M > 16 and cfg["kernel"] == "gemv":
        pytest.skip("the GEMV kernel takes at most 16 rows")
    N = 2048   # K = 200: the last group of 128 zero-padded
    qw, sc, zr = int4_weights(N, K, 128, torch.bfloat16, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # SERIAL: the second call reuses the workspace and its counters
        out = ql_mod.linear_int4_triton(x, qw, sc, zr, group_size=128, config=cfg)
        close(out, qo.linear_int4(x.float(), qw, sc.float(), zr, group_size=128), torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 2, 4, 16, 48, 512])
@pytest.mark.parametrize("K,N", GPU_SHAPES)
def test_int8_cuda(M, K, N):
    q8, s8 = int8_weights(N, K, torch.bfloat16, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    out = torch.ops.llmaccel.linear_int8(x, q8, s8, None)
    close(out, qo.linear_int8(x.float(), q8, s8.float()), torch.bfloat16)


@pytest.mark.parametrize("M,N,K", [(1, 40, 64), (5, 96, 576), (3, 17, 7), (130, 24, 40)])
def test_int8_mm_cpu_is_x_at_16_bits_a_row_times_the_int8_weight(M, N, K):
    # x rounded to 16 bits per row (absmax / 32767, half to even); the two int8 halves' int32
    # sums are exact, their fp32 combination and scaling a few 2^-24 of the largest term
    from llmaccel.kernels.int_codes import int8_codes_cpu, int8_mm_cpu
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    q8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s8 = torch.rand(N, generator=g) * 0.02 + 0.001
    x = torch.randn(2, M, K, generator=g) * 3
    x[0, 0, :] = 0  # an all-zero row: scale clamped, output the bias
    x[1, -1, 0] = 1e4  # an outlier: the row's other elements keep ~1e4 / 65534 of precision
    b = torch.randn(N, generator=g)
    out = int8_mm_cpu(x, *int8_codes_cpu(q8, s8), b)
    xd = x.double()
    s = xd.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 32767
    want = torch.nn.functional.linear(torch.round(xd / s) * s, q8.double() * s8.double()[:, None],
                                      b.double())
    assert out.dtype == torch.float32 and out.shape == (2, M, N)
    mag = (xd.abs() @ (q8.double().abs() * s8.double()[:, None]).T).amax() + 1
    assert ((out.double() - want).abs() <= 2 ** -20 * mag).all()
    exact = torch.nn.functional.linear(xd, q8.double() * s8.double()[:, None], b.double())
    assert ((out.double() - exact).abs() <= 2 ** -12 * mag).all()
    assert int8_mm_cpu(x.bfloat16(), *int8_codes_cpu(q8, s8)).dtype == torch.bfloat16


def test_cpu_lowering_calls_the_int8_form_directly():
    from llmaccel.codegen.lower import lower
    from llmaccel.compiler.pipeline import compile

    m = compile("preset:tiny-llama", ["quant"], {"quant": {"bits": "8", "method": "rtn"}},
                eval_tokens=0, progress=False)
    low, rep = lower(m.gm, max_len=64)
    assert rep.cpu_traced.get("linear_int8", 0) > 0 and "linear_int8" not in rep.custom, rep
    ids = torch.randint(0, 512, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    ref_out = m.gm(ids, pos, None)
    out = low(ids, pos, None)
    # the form rounds x to 16 bits per row, the head's weights to int8 per row (half a step of
    # absmax / 127 a weight)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2 * ref_out.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K,gs", [(32, 128, 32), (48, 320, 64), (16, 576, 128)])
def test_int4_cpu_form_matches_the_reference(N, K, gs, dtype):
    # aten's CPU int4 GEMM on weights converted once (prepare_int4_cpu); K not a multiple of the
    # group (576 in groups of 128) pads x. Tolerance: x, the scale and the float zero
    # (8 - z) * scale are rounded to bf16 (fp32 x too: cpu_act_dtype) and aten dequantizes in
    # bf16 (2^-8 relative each).
    from llmaccel.kernels.quant_linear import linear_int4_cpu, prepare_int4_cpu

    qw, sc, zr = int4_weights(N, K, gs, dtype)
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(2, 3, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    packed, sz = prepare_int4_cpu(qw, sc, zr, gs)
    out = linear_int4_cpu(x, packed, sz, b, group_size=gs)
    want = qo.linear_int4(x.double(), qw, sc.double(), zr, b.double(), group_size=gs)
    w = qo.dequantize_int4(qw, sc, zr, gs, torch.float64)[:, :K]
    scale = (x.double().abs() @ w.abs().T).amax() + 1
    tol = 2 ** -6
    assert out.dtype == dtype and out.shape == (2, 3, N)
    assert ((out.double() - want).abs() <= tol * scale).all()
    assert prepare_int4_cpu(qw[:8], sc[:8], zr[:8], gs) is None  # N not a multiple of 16: op stays


def test_cpu_lowering_prepares_int4_weights_once():
    from llmaccel.codegen.lower import lower
    from llmaccel.compiler.pipeline import compile

    m = compile("preset:tiny-llama", ["fuse", "quant"],
                {"quant": {"bits": "4", "group_size": "32", "method": "rtn"}}, eval_tokens=0, progress=False)
    shared: dict = {}
    low, rep = lower(m.gm, max_len=64, prepared=shared)
    assert rep.cpu_traced.get("linear_int4", 0) > 0 and "linear_int4" not in rep.custom, rep
    low2, _ = lower(m.gm, max_len=64, last_only=True, prepared=shared)
    assert low2._cpu0.w0.data_ptr() == low._cpu0.w0.data_ptr()  # one converted copy, reused
    assert not any(n.op == "get_attr" and "qweight" in n.target for n in low.graph.nodes)
    ids = torch.randint(0, 512, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    ref_out = m.gm(ids, pos, None)
    # the CPU form runs x in bf16 (cpu_act_dtype): a few bf16 roundings of the logits' scale
    torch.testing.assert_close(low(ids, pos, None), ref_out, rtol=2e-2, atol=2e-2 * ref_out.abs().max().item())


def test_the_dotasm_probe_builds_a_valid_case(ql):
    """The start-up check of the PTX kernel (_asm_works) runs this case; with a pure-Triton tile
    under the interpreter it must match the reference, so only the PTX kernel can fail it."""
    cfg = dict(kernel="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_G=2, SPLIT_K=1, num_warps=4)
    assert ql._probe_matches(torch.device("cpu"), torch.float32, cfg)


@pytest.mark.cuda
def test_the_dotasm_kernel_serves_this_gpu():
    assert ql_mod._asm_works(torch.cuda.current_device())


@pytest.mark.parametrize("bits", ["4", "8"])
def test_cpu_forms_compile_with_inductor(bits):
    """`--compile on` on a CPU: Inductor takes the aten int4 weight-only GEMM and the int8 x int8
    GEMM with their weights converted at lowering (a conversion inside the step would be a
    pointwise node its lowering of those ops refuses)."""
    from llmaccel.codegen.lower import lower
    from llmaccel.compiler.pipeline import compile

    m = compile("preset:tiny-llama", ["quant"], {"quant": {"bits": bits, "group_size": "32", "method": "rtn"}},
                eval_tokens=0, progress=False)
    low, rep = lower(m.gm, max_len=64)
    assert rep.cpu_traced.get(f"linear_int{bits}", 0) > 0, rep
    ids = torch.randint(0, 512, (1, 5))
    pos = torch.arange(5)[None]
    want = low(ids, pos, None)
    torch._dynamo.reset()
    got = torch.compile(low)(ids, pos, None)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
