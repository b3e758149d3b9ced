"""On the GPU: `LLM`'s decode runner (lowered kernels, Inductor, CUDA graphs, sampling inside)
against the reference executor, fp32 so that greedy text has no ties to break differently."""
import pytest
import torch
import torch._dynamo

from llmaccel import LLM
from llmaccel.compiler.pipeline import compile
from llmaccel.sampling import SamplingParams

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
W4 = {"quant": {"method": "rtn", "bits": 4, "group_size": 32, "lm_head": True}}


def _reference(m, prompts, params=GREEDY):
    """The reference executor's tokens (m is compiled in fp32 on the GPU)."""
    return [list(m.generate_ids(p, params)) for p in prompts]


@pytest.mark.parametrize("passes,opts", [(["fuse"], {}), (["fuse", "quant"], W4)], ids=["fuse", "w4"])
@pytest.mark.parametrize("compile_step", [True, False], ids=["inductor", "eager"])
def test_llm_greedy_identical_to_reference_at_one_and_many_rows(passes, opts, compile_step):
    """One request (the fused GEMVs, gemv_int4 for W4) and five at once (GEMMs, padding rows)."""
    torch._dynamo.reset()
    m = compile("preset:tiny-llama", passes, opts, device="cuda", progress=False, eval_tokens=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6, 17, 3, 30, 9)]
    want = _reference(m, prompts)
    llm = LLM(m, compile=compile_step)
    assert [o.token_ids for o in llm.generate(prompts[:1], GREEDY)] == want[:1]
    assert llm.core.runner.decode.lowered["gemv"] is not None
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    met = llm.metrics()
    assert met["graphs_captured"] >= 2 and met["decode_steps"] > met["steps"]


def test_seeded_sampling_on_gpu_matches_reference_and_ignores_batch():
    torch._dynamo.reset()
    m = compile("preset:tiny-llama", ["fuse"], device="cuda", progress=False, eval_tokens=0)
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=16, seed=5, ignore_eos=True)
    prompt = list(range(5, 25))
    want = _reference(m, [prompt], p)[0]
    llm = LLM(m)
    assert llm.generate([prompt], p)[0].token_ids == want
    others = [SamplingParams(temperature=1.0, max_tokens=16, seed=i, ignore_eos=True) for i in range(6)]
    outs = llm.generate([list(range(3, 10 + i)) for i in range(6)] + [prompt], others + [p])
    assert outs[-1].token_ids == want


def test_bench_on_gpu_reports_roofline_and_profile():
    from llmaccel.bench.run import bench

    torch._dynamo.reset()
    res = bench("preset:smollm2-135m", batch=2, prompt_len=16, gen_len=24, warmup=1)
    assert res["device"].startswith("cuda") and res["graphs_captured"] > 0
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
