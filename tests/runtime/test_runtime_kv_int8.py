"""kvquant.bits=8 (int8 rows) through the pass, the reference executor and the paged runtime:
greedy tokens identical to the reference executor's (fp32, the CPU's exact path) on the decode
runner, with preemption, prefix caching and speculative decoding; the cache's bytes; the export
refusal."""
import pytest
import torch

from llmaccel import LLM, SamplingParams
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.ops.kv_int8 import int8_layers

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def case():
    m = compile("preset:tiny-llama", ["fuse", "kvquant"], {"kvquant": {"bits": "8"}}, eval_tokens=0,
                progress=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 70, 1, 33)]
    prompts.append([7, 8, 9] * 10)  # repeats: ngram proposes
    return m, prompts, [list(m.generate_ids(p, GREEDY)) for p in prompts]


def test_pass_marks_every_attention_and_states_the_bytes(case):
    from llmaccel import load
    from llmaccel.passes.base import PassContext, Progress, make_config
    from llmaccel.passes.kvquant import KVQuant

    m, _, _ = case
    assert int8_layers(m.gm) == {0, 1}
    src = load("preset:tiny-llama")
    res = KVQuant(make_config(KVQuant, {"bits": "8"})).run(src.gm, PassContext(src.config, progress=Progress(False)))
    st = res.stats
    assert res.changed == 2 and st["bits"] == 8
    L, H, D = 2, 2, 16  # tiny-llama: layers, KV heads, head_dim
    assert st["kv_bytes_per_token"] == L * 2 * H * (D + 2) and st["compression"] == round(D * 2 / (D + 2), 2)
    for first, then in (("4", "8"), ("8", "4")):  # a quantized cache is not quantized again
        g = load("preset:tiny-llama")
        ctx = PassContext(g.config, progress=Progress(False))
        KVQuant(make_config(KVQuant, {"bits": first})).run(g.gm, ctx)
        with pytest.raises(LlmaccelError, match="already"):
            KVQuant(make_config(KVQuant, {"bits": then})).run(g.gm, ctx)


def test_cache_through_chunks_equals_one_pass_through_the_cache(case):
    """Every token is coded as it is stored: chunking the prefill changes nothing, and the
    logits stay near the unquantized model's."""
    m, prompts, _ = case
    ids = torch.tensor([prompts[2][:64]])
    one = m.logits(ids, 0, m.new_cache(1, 64))
    c = m.new_cache(1, 64)
    parts = torch.cat([m.logits(ids[:, s:s + 16], s, c) for s in range(0, 64, 16)], 1)
    torch.testing.assert_close(parts, one, atol=1e-5, rtol=1e-5)
    plain = m.logits(ids)  # no cache: the unquantized attention
    assert 0 < (one - plain).abs().max() < 0.1 * plain.abs().max()


@pytest.mark.parametrize("kw", [
    {},
    {"kv_cache_tokens": 128, "block_size": 8},  # preemption (the longest request holds 110)
    {"speculative": "ngram"},
    {"speculative": "self"},  # an int8-weight copy: its own int8 cache
    {"max_num_seqs": 3, "enable_prefix_caching": True},
], ids=["batched", "preempt", "ngram", "self", "prefix"])
def test_greedy_matches_reference_executor(case, kw):
    m, prompts, ref = case
    llm = LLM(m, **kw)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    s = llm.metrics()
    assert s["kv_dtype"] == "int8" and s["kv_blocks_used"] == 0
    if not kw.get("speculative"):
        assert s["decode_steps"] > s["steps"] // 2  # on the decode runner
    if kw.get("kv_cache_tokens"):
        assert s["preemptions"] > 0
    assert 1 <= s["running_peak"] <= len(prompts)


def test_same_bytes_hold_more_tokens_and_run_more_requests(case):
    m, prompts, ref = case
    base = compile("preset:tiny-llama", ["fuse"], {}, eval_tokens=0, progress=False)
    L, H, D = 2, 2, 16  # tiny-llama: layers, KV heads, head_dim
    budget = 80 * L * 2 * H * D * 4  # 80 fp32 tokens: one request of 70 + 40 at most
    runs = {}
    for name, model in (("int8", m), ("fp32", base)):
        llm = LLM(model, kv_cache_bytes=budget, block_size=8)
        outs = llm.generate([p[:30] for p in prompts], GREEDY)
        runs[name] = llm.metrics()
        assert all(len(o.token_ids) == 40 for o in outs)
    q, b = runs["int8"], runs["fp32"]
    assert q["kv_bytes_per_token"] == L * 2 * H * (D + 2) and b["kv_bytes_per_token"] == L * 2 * H * D * 4
    assert q["kv_cache_tokens"] >= 3 * b["kv_cache_tokens"]  # 1 + 2/16 bytes a number against 4
    assert q["running_peak"] > b["running_peak"]
    with pytest.raises(LlmaccelError, match="not both"):
        LLM(m, kv_cache_bytes=budget, kv_cache_tokens=64)


def test_export_refuses_the_int8_cache(case, tmp_path):
    from llmaccel.export.exporter import check_translatable, translations

    m, _, _ = case
    with pytest.raises(LlmaccelError, match="int8 rows") as e:
        check_translatable(m.gm, translations("onnx"))
    assert "\n" not in str(e.value)


def test_compile_report_checks_quality_at_a_long_context():
    m = compile("preset:tiny-llama", ["kvquant"], {"kvquant": {"bits": "8"}}, eval_tokens=300, eval_ctx=128,
                progress=False)
    q = m.report["quality"]
    assert q["ctx"] == 128 and q["tokens"] == 299 and q["chunk"] == 512  # through the cache
    assert abs(q["delta_ppl_pct"]) < 5 and q["kl"] > 0
    with pytest.raises(LlmaccelError, match=r"eval_ctx must be 2 \.\. \d+"):
        compile("preset:tiny-llama", ["kvquant"], {"kvquant": {"bits": "8"}}, eval_ctx=10**6, progress=False)
