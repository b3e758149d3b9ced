"""The paged runtime on tiny presets against the reference executor (the oracle)."""
import pytest
import torch

from llmaccel import LLM, SamplingParams, load
from llmaccel.errors import LlmaccelError
from llmaccel.runtime.block_manager import BlockManager
from llmaccel.runtime.sequence import Sequence
from llmaccel.runtime.speculative import verify
from tests.runtime.conftest import GREEDY, check_logprobs, lowered

@pytest.mark.parametrize("kw", [
    {},
    {"kv_cache_tokens": 96, "block_size": 8},  # 12 blocks for 6 sequences: preemption
    {"kv_cache_tokens": 120, "block_size": 3, "max_num_batched_tokens": 16},  # odd blocks, chunks
    {"speculative": "self"},
    {"speculative": "self:int4"},
    {"speculative": "ngram"},
    {"speculative": "preset:tiny-llama", "num_speculative_tokens": 3},  # a draft model (== target)
    {"max_num_seqs": 5},  # decode buckets 1, 2, 4, 5: padding rows
], ids=["batched", "preempt", "chunked", "self", "self-int4", "ngram", "draft-model", "buckets"])
def test_greedy_matches_reference_executor(tiny, prompts, reference, kw):
    llm = LLM(tiny, **kw)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    m = llm.metrics()
    assert m["kv_blocks_used"] == 0  # everything freed
    # decode steps run on the decode runner (several sub-steps each) unless a draft proposes: a
    # model draft always does, ngram only where the text repeats (test_ngram.py)
    assert (m["decode_steps"] > m["steps"] // 2) == (kw.get("speculative") in (None, "ngram"))
    if kw.get("block_size") == 3:  # 52 tokens in blocks of 3: wide tables
        assert any(w > 8 for _, w, *_ in llm.core.runner.decode.graphs)
    if kw.get("kv_cache_tokens") == 96:
        assert m["preemptions"] > 0
    if kw.get("speculative") == "preset:tiny-llama":
        assert m["spec_accept_rate"] == 1.0 and m["spec_tokens_per_step"] > 3


def test_bad_speculative_options_are_clear(tiny):

    # self:N (the target's first N layers) was removed: one line naming the drafts there are
    with pytest.raises(LlmaccelError, match=r"unknown draft 'self:3'; the drafts are self .*self:int4, "
                                            r"ngram") as e:
        LLM(tiny, speculative="self:3")
    assert "\n" not in str(e.value)
    with pytest.raises(LlmaccelError, match="unknown model"):
        LLM(tiny, speculative="no-such-draft")


def test_gpt2_family_runs_on_the_paged_cache():
    m = load("preset:tiny-gpt2")
    p = [[1, 2, 3, 4, 5], [7] * 20]
    ref = [list(m.generate_ids(x, GREEDY)) for x in p]
    assert [o.token_ids for o in LLM(m, block_size=4).generate(p, GREEDY)] == ref


def test_graphs_from_exact_and_weight_passes_run(prompts):
    from llmaccel import compile

    m = compile("preset:tiny-llama", ["quant", "fuse"], {"quant": {"bits": 8, "method": "rtn"}},
                eval_tokens=0, progress=False)
    # the reference executor over the graph lowered as the engine lowers it: the same int8 CPU
    # form (x in bf16, kernels/int_codes.cpu_act_dtype), so this checks the engine alone; the
    # form against the op's reference: tests/kernels/test_quant_linear.py
    want = [list(lowered(m).generate_ids(p, GREEDY)) for p in prompts[:3]]
    assert [o.token_ids for o in LLM(m, block_size=4).generate(prompts[:3], GREEDY)] == want


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_lm_head_runs_on_the_sampled_rows_only(prompts, bits):
    from llmaccel import compile
    from llmaccel.runtime.graph import runtime_graph

    m = compile("preset:tiny-llama", ["fuse", "quant"],
                {"quant": {"bits": bits, "group_size": 32, "method": "rtn", "lm_head": True}},
                eval_tokens=0, progress=False)
    assert getattr(runtime_graph(m.gm), "selects_rows", False)
    want = [list(m.generate_ids(p, GREEDY)) for p in prompts[:3]]
    assert [o.token_ids for o in LLM(m, block_size=4).generate(prompts[:3], GREEDY)] == want


def test_too_long_prompts_fail_alone(tiny, prompts, reference):
    llm = LLM(tiny, kv_cache_tokens=64, block_size=8)
    outs = llm.generate([prompts[0], [5] * 600, [5] * 80, prompts[1]], GREEDY)
    assert outs[0].token_ids == reference[0] and outs[3].token_ids == reference[1]
    assert outs[1].finish_reason == "error" and "model context is 512" in outs[1].error
    assert outs[2].finish_reason == "error" and "KV cache holds 64" in outs[2].error
    assert llm.metrics()["requests_failed"] == 2


def test_prefix_caching_shares_blocks_and_keeps_outputs(tiny):
    prefix = list(range(10, 74))  # 4 full blocks of 16
    a, b = prefix + [3, 4], prefix + [9, 8, 7]
    ref = [list(tiny.generate_ids(x, GREEDY)) for x in (a, b)]
    peaks = {}
    for caching in (True, False):
        # The budget admits `a` alone in the first step; `b` arrives when a's blocks are cached.
        llm = LLM(tiny, enable_prefix_caching=caching, max_num_batched_tokens=66)
        outs = llm.generate([a, b], GREEDY)
        assert [o.token_ids for o in outs] == ref
        peaks[caching] = llm.metrics()["kv_blocks_peak"]
        if caching:
            assert llm.metrics()["prefix_cache_hit_tokens"] == 64
    assert peaks[True] <= peaks[False] - 4


def test_copy_on_write_and_refcounts():
    bm = BlockManager(6, 4)
    s1 = Sequence(list(range(9)), GREEDY, None, "cpu")
    assert bm.grow(s1, 9) and len(s1.block_table) == 3
    s1.num_computed = 9
    bm.register(s1)
    s2 = Sequence(list(range(9)) + [5], GREEDY, None, "cpu")
    assert bm.match_prefix(s2) == 8 and s2.block_table == s1.block_table[:2]
    assert bm.blocks[s1.block_table[0]].ref == 2
    assert bm.make_writable(s2, 4, 6)  # writing into a shared block copies it
    assert s2.block_table[1] != s1.block_table[1] and bm.copies == [(s1.block_table[1], s2.block_table[1])]
    bm.free_seq(s1)
    bm.free_seq(s2)
    assert bm.num_free == 6


def test_seeded_sampling_is_reproducible_and_independent_of_batching(tiny, prompts):
    p = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    alone = LLM(tiny).generate([prompts[2]], p)[0].token_ids
    batched = LLM(tiny, block_size=4).generate(prompts, [GREEDY] * 2 + [p] + [GREEDY] * 3)
    assert batched[2].token_ids == alone
    ref = list(tiny.generate_ids(prompts[2], p))  # same seed, same draws as the reference executor
    assert alone == ref


def test_eos_and_streaming(tiny, prompts):
    llm = LLM(tiny)
    full = llm.generate([prompts[1]], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    eos = full[5]
    tiny.config.eos_token_id, old = eos, tiny.config.eos_token_id
    try:
        llm = LLM(tiny)
        out = llm.generate([prompts[1]], SamplingParams(max_tokens=20))[0]
        assert out.finish_reason == "stop" and out.token_ids == full[: full.index(eos)]
    finally:
        tiny.config.eos_token_id = old
    assert list(LLM(tiny).stream(prompts[1], GREEDY)) == []  # no tokenizer: no text


def _chi2_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square p-value for equal-sized samples, bins with few counts pooled."""
    big = (a + b) >= 10
    a = torch.cat([a[big], a[~big].sum()[None]]).double()
    b = torch.cat([b[big], b[~big].sum()[None]]).double()
    keep = (a + b) > 0
    stat = ((a[keep] - b[keep]) ** 2 / (a[keep] + b[keep])).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))


def _histograms(llm_or_model, n, seed0, prompt, vocab):
    ps = [SamplingParams(temperature=1.0, max_tokens=4, seed=seed0 + i, ignore_eos=True) for i in range(n)]
    outs = llm_or_model.generate([prompt] * n, ps)
    toks = torch.tensor([o.token_ids for o in outs])
    return [torch.bincount(toks[:, j], minlength=vocab) for j in range(1, 4)]


def _perturbed_draft(path) -> str:
    """An artifact of the tiny preset with noise of 0.3 std added to every weight: a draft whose
    proposals the target rejects often (about 40% accepted) and whose own distribution 1,500
    samples tell apart from the target's (the int8 / int4 copies are too close to it)."""
    d = load("preset:tiny-llama")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in d.gm.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
    d.save(path)
    return str(path)


def test_speculative_sampling_keeps_the_target_distribution(tiny, tmp_path):
    spec, prompt, n, V = _perturbed_draft(tmp_path / "draft"), [5, 6, 7, 5, 6, 7, 5, 6], 1500, \
        tiny.config.vocab_size
    plain = _histograms(LLM(tiny, max_num_seqs=n), n, 0, prompt, V)
    llm = LLM(tiny, speculative=spec, num_speculative_tokens=2, max_num_seqs=n)
    specd = _histograms(llm, n, 10 ** 6, prompt, V)
    assert llm.metrics()["spec_proposed"] > 0 and llm.metrics()["spec_accepted"] > 0
    for a, b in zip(plain, specd):
        assert _chi2_p(a, b) > 1e-3
    # The test has power: the draft's own distribution is told apart from the target's.
    d = _histograms(LLM(spec, max_num_seqs=n), n, 0, prompt, V)
    assert min(_chi2_p(a, b) for a, b in zip(plain, d)) < 1e-4


@pytest.mark.parametrize("draft", ["one-hot", "model"])
def test_rejection_sampling_output_follows_the_target(draft):
    """verify() alone: whatever q proposed, the first emitted token is distributed as p."""
    g = torch.Generator().manual_seed(0)
    V, n = 6, 6000
    logits = torch.randn(3, V, generator=g) * 1.5
    p0 = torch.softmax(logits[0], -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(V)
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        if draft == "one-hot":
            prop, qp = [int(p0.argmax()), 1], None
        else:
            prop = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
            qp = q
        counts[verify(logits, prop, qp, params, gen)[0]] += 1
    want = p0 * n
    stat = ((counts - want) ** 2 / want).sum()
    assert float(torch.special.gammaincc(torch.tensor((V - 1) / 2.0), stat / 2)) > 1e-3


def test_kivi_cache_decodes_eagerly():
    from llmaccel.compiler.pipeline import compile

    m = compile("preset:tiny-llama", ["kvquant"], {"kvquant": {"bits": 4, "residual": 32}},
                eval_tokens=0, progress=False)
    assert LLM(m).core.runner.decode is None


@pytest.mark.parametrize("kw", [{}, {"speculative": "ngram"}], ids=["plain", "ngram"])
def test_logprobs_follow_the_reference_logits(tiny, prompts, kw):
    """Greedy with logprobs=3: each token's logprob is the max of the reference executor's
    log-softmax at its position, and the top list starts with the token itself."""
    p = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
    outs = LLM(tiny, **kw).generate(prompts[:3], p)
    check_logprobs(tiny, prompts[:3], outs, top=3, n=10)
    assert LLM(tiny).generate(prompts[:1], GREEDY)[0].logprobs is None
    with pytest.raises(Exception, match="logprobs must be in 0..20"):
        SamplingParams(logprobs=21)


def test_bad_python_inputs_are_one_clear_error(tiny):
    from llmaccel.errors import LlmaccelError

    llm = LLM(tiny)
    for bad, match in ((123, "prompts must be"), ([None], "a prompt is a string or a list of token ids"),
                       ({"a": 1}, "prompts must be"), ([[1, 2, 10 ** 6]], "outside the vocabulary"),
                       (["text"], "has no tokenizer")):
        with pytest.raises(LlmaccelError, match=match):
            llm.generate(bad, GREEDY)
    with pytest.raises(LlmaccelError, match="stream takes one prompt"):
        list(llm.stream([[1, 2], [3]]))
    with pytest.raises(LlmaccelError, match="sampling params must be"):
        llm.generate([[1, 2]], {"max_tokens": 3})
    for kw in (dict(max_tokens="8"), dict(temperature="0.5"), dict(top_k=1.5), dict(stop=[""]),
               dict(seed="x"), dict(ignore_eos=1)):
        with pytest.raises(LlmaccelError, match=next(iter(kw))):
            SamplingParams(**kw)
    assert SamplingParams(stop=".").stop == ["."]
    assert llm.metrics()["kv_blocks_used"] == 0 and not llm.core.sched.has_work()


def test_abort_frees_blocks_and_leaves_the_others_exact(tiny, prompts, reference):
    llm = LLM(tiny, kv_cache_tokens=256, block_size=8)
    seqs = [llm.add_request(p, GREEDY) for p in prompts]
    waiting = llm.add_request(prompts[0], GREEDY)
    llm.step()
    llm.abort(seqs[1])  # running
    llm.abort(waiting)  # may still be waiting
    while llm.has_unfinished():
        llm.step()
    assert seqs[1].finish_reason == waiting.finish_reason == "abort"
    for i, s in enumerate(seqs):
        if i != 1:
            assert llm.output(s).token_ids == reference[i]
    assert llm.metrics()["kv_blocks_used"] == 0


def test_small_steps_over_prefix_cache_hits(tiny):
    """Step-graph steps that start past a cached prefix (start > 0), with a padding sequence
    longer than a block: the reference executor's tokens."""
    from llmaccel.runtime.step_graphs import StepGraphs

    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, 500, (45,), generator=g).tolist()
    prompts = [base + [7, 8, 9], base + [11], base[:20] + [5] * 30]
    ref = [list(tiny.generate_ids(p, GREEDY)) for p in prompts]
    llm = LLM(tiny, block_size=4)
    llm.core.runner.steps = StepGraphs(llm.core.runner.gm, llm.core.cache, scratch=llm.core.cache.num_blocks - 1, capture=False,
                           max_tokens=128)
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == ref
    assert llm.metrics()["prefix_cache_hit_tokens"] > 0
