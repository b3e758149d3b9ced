"""On the GPU: the compiled decode step (Inductor, CUDA graphs) against the reference executor.

bf16 tolerance: the lowered path may differ from the fp32 truth by at most twice what the bf16
reference executor itself differs from it (plus 1e-3), on the same bf16 weights.
"""
import copy

import pytest
import torch
import torch._dynamo

from llmaccel.codegen.engine import DecodeEngine
from llmaccel.compiler import executor
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.ops.attention import ContiguousKVCache
from llmaccel.runtime.sampler import SamplingParams

pytestmark = pytest.mark.cuda


def _stepwise(eng, ids, split):
    out = [eng.logits(ids[:, :split], 0)]
    out += [eng.logits(ids[:, t:t + 1], t) for t in range(split, ids.shape[1])]
    return torch.cat(out, 1)


def _ref_stepwise(gm, ids, split, dtype):
    cache = ContiguousKVCache(ids.shape[0], ids.shape[1], dtype, "cuda")
    out = [executor.forward(gm, ids[:, :split], 0, cache)]
    out += [executor.forward(gm, ids[:, t:t + 1], t, cache) for t in range(split, ids.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("linear", ["rows", "mm"])
def test_fp32_tiny_compiled_matches_and_greedy_identical(linear):
    torch._dynamo.reset()
    src = "preset:tiny-llama"
    ref = load(src, device="cuda")
    ids = torch.randint(0, 512, (1, 12), device="cuda")
    eng = DecodeEngine(compile(src, ["fuse"], device="cuda", progress=False), 1, 64, linear=linear)
    assert eng.compiled
    out = _stepwise(eng, ids, 5)
    want = ref.logits(ids)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    got = eng.generate(ids[:, :6], 20)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    greedy = list(executor.generate_ids(ref.gm, ids[0, :6].tolist(), params, eos_ids=set(),
                                        max_len=512, dtype=torch.float32, device="cuda"))
    assert got[0].tolist() == greedy


@pytest.mark.parametrize("batch", [1, 4])
def test_bf16_real_shape_within_bf16_noise(batch):
    torch._dynamo.reset()
    src = "preset:smollm2-135m"
    m = compile(src, ["fuse"], dtype="bfloat16", device="cuda", progress=False)
    ref16 = load(src, dtype="bfloat16", device="cuda")
    ref32 = copy.deepcopy(ref16.gm).float()
    ids = torch.randint(0, m.config.vocab_size, (batch, 40), device="cuda")
    eng = DecodeEngine(m, batch, 64)
    ours = _stepwise(eng, ids, 32).float()
    truth = _ref_stepwise(ref32, ids, 32, torch.float32)
    base = _ref_stepwise(ref16.gm, ids, 32, torch.bfloat16).float()
    err_ref = (base - truth).abs().max().item()
    err_ours = (ours - truth).abs().max().item()
    assert err_ours <= 2 * err_ref + 1e-3, (err_ours, err_ref)


W4 = {"quant": {"method": "rtn", "bits": 4, "group_size": 64, "lm_head": True}}


def test_int4_gemv_step_within_bf16_noise_and_greedy_identical():
    """W4 with an int4 LM head at batch 1: the decode step is llmaccel::gemv_int4 throughout
    (norms, SiLU-mul, residual adds inside); its logits against the reference executor on the
    same quantized weights (bf16 rule above), and fp32 greedy text identical on a tiny model."""
    torch._dynamo.reset()
    src = "preset:smollm2-135m"
    m = compile(src, ["fuse", "quant"], W4, dtype="bfloat16", device="cuda", progress=False, eval_tokens=0)
    eng = DecodeEngine(m, 1, 64)
    assert eng.linear == "gemv" and eng.decode_report.gemv["int4"] == 4 * m.config.n_layers + 1
    ids = torch.randint(0, m.config.vocab_size, (1, 40), device="cuda")
    ours = _stepwise(eng, ids, 32).float()
    g32 = copy.deepcopy(m.gm).float()
    truth = _ref_stepwise(g32, ids, 32, torch.float32)
    base = _ref_stepwise(m.gm, ids, 32, torch.bfloat16).float()
    err_ref = (base - truth).abs().max().item()
    err_ours = (ours - truth).abs().max().item()
    assert err_ours <= 2 * err_ref + 1e-3, (err_ours, err_ref)

    torch._dynamo.reset()
    t = compile("preset:tiny-llama", ["fuse", "quant"], {"quant": {**W4["quant"], "group_size": 32}},
                device="cuda", progress=False, eval_tokens=0)
    eng = DecodeEngine(t, 1, 64)
    ids = torch.randint(0, 512, (1, 6), device="cuda")
    got = eng.generate(ids, 20)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    greedy = list(executor.generate_ids(t.gm, ids[0].tolist(), params, eos_ids=set(),
                                        max_len=512, dtype=torch.float32, device="cuda"))
    assert got[0].tolist() == greedy


KV2 = {"kvquant": {"bits": 2, "group": 16, "residual": 32}}


def _kivi_ref_stepwise(gm, ids, split, dtype):
    ctx = executor.make_cache(gm, ids.shape[0], ids.shape[1], dtype, "cuda")
    out = [executor.forward(gm, ids[:, :split], 0, ctx)]
    out += [executor.forward(gm, ids[:, t:t + 1], t, ctx) for t in range(split, ids.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("batch", [1, 3])
def test_kivi_static_step_within_bf16_noise_and_greedy_identical(batch):
    """A KV2 graph on the static path (llmaccel::static_kivi_decode in the CUDA-graph step)
    against the reference QuantizedKVCache (bf16 rule above; groups age during the steps), and
    fp32 greedy text identical on a tiny model."""
    torch._dynamo.reset()
    src = "preset:smollm2-135m"
    m = compile(src, ["fuse", "kvquant"], KV2, dtype="bfloat16", device="cuda", progress=False, eval_tokens=0)
    eng = DecodeEngine(m, batch, 256)
    ids = torch.randint(0, m.config.vocab_size, (batch, 200), device="cuda")
    ours = _stepwise(eng, ids, 150).float()
    truth = _kivi_ref_stepwise(copy.deepcopy(m.gm).float(), ids, 150, torch.float32)
    base = _kivi_ref_stepwise(m.gm, ids, 150, torch.bfloat16).float()
    err_ref = (base - truth).abs().max().item()
    err_ours = (ours - truth).abs().max().item()
    assert err_ours <= 2 * err_ref + 1e-3, (err_ours, err_ref)

    torch._dynamo.reset()
    t = compile("preset:tiny-llama", ["fuse", "kvquant"], {"kvquant": {"bits": 2, "group": 16, "residual": 16}},
                device="cuda", progress=False, eval_tokens=0)
    eng = DecodeEngine(t, batch, 128)
    ids = torch.randint(0, 512, (batch, 21), device="cuda")
    got = eng.generate(ids, 60)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for b in range(batch):
        greedy = list(executor.generate_ids(t.gm, ids[b].tolist(), params, eos_ids=set(),
                                            max_len=512, dtype=torch.float32, device="cuda"))
        assert got[b].tolist() == greedy


def test_bench_on_gpu_reports_roofline_and_profile():
    from llmaccel.bench.run import bench

    torch._dynamo.reset()
    res = bench("preset:smollm2-135m", batch=2, prompt_len=16, gen_len=24, warmup=2)
    assert res["device"].startswith("cuda") and res["compiled"]
    assert 0 < res["roofline_frac"] < 1.5 and res["kernels_per_step"] > 0, res
    assert res["peak_mem_bytes"] > res["weight_bytes"]


def test_backend_on_gpu_matches_eager_hf_llama():
    from helpers import hf_for_source
    from llmaccel.codegen.backend import llmaccel_backend

    torch._dynamo.reset()
    m = hf_for_source("preset:tiny-llama").cuda()
    ids = torch.randint(0, 512, (2, 9), device="cuda")
    with torch.no_grad():
        ref = m(ids).logits
        out = torch.compile(m, backend=llmaccel_backend)(ids).logits
    assert llmaccel_backend.last_stats["lifted"]["rms_norm"] == 5
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
