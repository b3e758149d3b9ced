"""Decode graphs, the warm-up and the padded step graphs of the paged runtime: batch and step
buckets, capture (stand-ins on the CPU, CUDA graphs with -m cuda), failures and caps, against
the reference executor."""
import pytest
import torch

from llmaccel import LLM, SamplingParams, load
from llmaccel.errors import LlmaccelError
from tests.runtime.conftest import GREEDY


def test_decode_graph_buckets():
    from llmaccel.runtime.decode import batch_buckets

    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(70) == [1, 2, 4, 8, 16, 32, 48, 64, 70]


@pytest.mark.cuda
def test_cuda_graph_decode_matches_reference_executor(prompts):
    """On the GPU (fp32: no greedy ties): decode steps replayed as CUDA graphs, preemption and
    chunked prefill between them, equal to the reference executor; then 40 requests (batch
    buckets up to 48) against the eager runtime."""
    import gc

    m = load("preset:tiny-llama", dtype=torch.float32, device="cuda")
    ref = [list(m.generate_ids(p, GREEDY)) for p in prompts]
    for kw in ({}, {"kv_cache_tokens": 96, "block_size": 8}, {"max_num_seqs": 3}):
        llm = LLM(m, **kw)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
        # a lone prompt's prefill step is the one replayed as a graph (step_graphs.py)
        assert [o.token_ids for o in llm.generate(prompts[:1], GREEDY)] == ref[:1]
        met = llm.metrics()
        assert met["graph_steps"] > 0 and met["graphs_captured"] > 0 and met["kv_blocks_used"] == 0
        assert met["step_graph_replays"] > 0 and not met["graph_failures"]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    g = torch.Generator().manual_seed(1)
    many = [torch.randint(3, 500, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 90, (40,), generator=g)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    eager = LLM(m, cuda_graphs=False, kv_cache_tokens=8192)
    want = [o.token_ids for o in eager.generate(many, params)]
    graphs = LLM(m, kv_cache_tokens=8192)
    got = [o.token_ids for o in graphs.generate(many, params)]
    assert got == want
    assert max(b for b, *_ in graphs.runner.graphs) >= 32


@pytest.mark.cuda
def test_a_dropped_engine_gives_its_memory_to_the_next():
    """Each LLM takes most of the GPU for its cache; one its caller dropped (a cycle of runners
    and graphs) must not hold it against the next one, without any reset by the caller."""
    m = load("preset:tiny-llama", dtype=torch.float32, device="cuda")
    for _ in range(3):
        llm = LLM(m)
        assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == GREEDY.max_tokens
        del llm


class _Replay:
    """A stand-in for a captured CUDA graph on a CPU: replay() runs the step again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def _capturing_llm(tiny, monkeypatch, **kw) -> LLM:
    """An LLM on the CPU whose decode runner and step graphs "capture" (_Replay stand-ins)."""
    import llmaccel.runtime.decode as decode
    import llmaccel.runtime.step_graphs as step_graphs

    def capture(fn, pool, device, reset=None):
        fn()
        if reset is not None:
            reset()
        return _Replay(fn)

    monkeypatch.setattr(decode, "cuda_graph", capture)
    monkeypatch.setattr(step_graphs, "cuda_graph", capture)
    llm = LLM(tiny, **kw)
    llm.core.runner.decode.capture = True
    llm.core.runner.steps = step_graphs.StepGraphs(llm.core.runner.gm, llm.core.cache, scratch=llm.core.cache.num_blocks - 1,
                                       capture=True, pool=object())  # no CUDA pool on a CPU
    return llm


def test_warmup_takes_every_shape_a_load_meets(tiny, prompts, reference, monkeypatch, capsys):
    """After LLM.warmup() no decode step and no lone prompt meets a shape of first use (a server
    warms up before it answers, so no request waits for a compile), and the tokens are the
    reference executor's, greedy and sampled, through the warmed shapes."""
    import llmaccel.runtime.step_graphs as step_graphs

    llm = _capturing_llm(tiny, monkeypatch, max_num_seqs=8)
    with pytest.raises(LlmaccelError, match="warm-up context"):
        llm.warmup(0)
    context = 300  # widths up to 32 blocks of 16 tokens: 8, 16, 32
    warm = llm.warmup(context, progress=True)
    m0 = llm.metrics()
    bar = capsys.readouterr().err  # the progress bar counts every shape, captured or run
    assert "warming up step shapes" in bar and f"{warm['shapes']}/{warm['shapes']}" in bar
    widths = llm.core.runner.decode.widths()
    assert widths == sorted(widths, reverse=True) and widths[-1] == step_graphs.MIN_WIDTH
    assert {llm.core.runner.decode.bucket(1, w)[1] for w in range(1, llm.core.runner.decode.max_blocks + 1)} == set(widths)
    eager = 2 * 3  # mixed steps at contexts 256 and 300, each beside a prompt of 8, 40 and 47 tokens
    assert m0["graphs_captured"] == 3 * len(llm.core.runner.decode.buckets) * 3 + len(llm.core.runner.steps.warm_keys())
    assert warm["shapes"] == m0["graphs_captured"] + eager
    for n in range(1, 9):  # every decode batch within the context meets a warmed shape
        for ctx in (1, 17, context):
            for mode in ("greedy", "sample", "filter"):
                assert (*llm.core.runner.decode.bucket(n, -(-ctx // 16)), mode, -1) in llm.core.runner.decode.graphs
    assert m0["graph_capture_s"] > 0
    for n in range(1, llm.core.runner.steps.max_tokens + 1):  # every lone prompt from position 0
        assert llm.core.runner.steps.shape([([0] * 64, 0, [1] * n)], [1]) in llm.core.runner.steps.graphs
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=5)
    want = [o.token_ids for o in LLM(tiny, max_num_seqs=8).generate(prompts, sampled)]
    assert [o.token_ids for o in llm.generate(prompts, sampled)] == want
    fresh = [7, 9, 11] * 7  # no prefix in the cache: a lone prompt's step
    assert llm.generate([fresh], GREEDY)[0].token_ids == list(tiny.generate_ids(fresh, GREEDY))
    m1 = llm.metrics()
    assert m1["graphs_captured"] == m0["graphs_captured"] and m1["graph_capture_s"] == m0["graph_capture_s"]
    assert m1["graph_steps"] > 0 and m1["step_graph_replays"] > 0


def test_warmup_of_one_sampling_mode_captures_its_steps_alone(tiny, monkeypatch):
    """warmup(modes=("sample",)): the decode steps of that mode only (the heal's sampler, which
    only ever asks for temperature-1 samples); a mode that does not exist is refused."""
    llm = _capturing_llm(tiny, monkeypatch, max_num_seqs=4)
    with pytest.raises(LlmaccelError, match="warm-up modes"):
        llm.warmup(64, modes=("beam",))
    llm.warmup(64, modes=("sample",))
    assert llm.core.runner.decode.graphs and {k[2] for k in llm.core.runner.decode.graphs} == {"sample"}
    captured = llm.metrics()["graphs_captured"]
    sampled = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=3)
    want = [o.token_ids for o in LLM(tiny, max_num_seqs=4).generate([[5, 6, 7]] * 3, sampled)]
    assert [o.token_ids for o in llm.generate([[5, 6, 7]] * 3, sampled)] == want
    assert llm.metrics()["graphs_captured"] == captured   # nothing captured on first use


def test_warmup_covers_requests_that_end_at_the_context(tiny, monkeypatch):
    """Requests whose prompt and max_tokens fill the warm-up context exactly meet no new decode
    shape: a group runs as many sub-steps as the row with the most tokens left wants, so a row
    one token from its end has its table grown past the context by up to MAX_STEPS - 2 tokens."""
    llm = _capturing_llm(tiny, monkeypatch, max_num_seqs=2)
    context = 128  # 8 blocks of 16: the narrowest width
    llm.warmup(context)
    before = set(llm.core.runner.decode.graphs)
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(3, 500, (n,), generator=g).tolist() for n in (100, 10))
    outs = llm.generate([a, b], [SamplingParams(max_tokens=context - 100, ignore_eos=True),
                                 SamplingParams(max_tokens=context - 10, ignore_eos=True)])
    assert [len(p) + len(o.token_ids) for p, o in zip((a, b), outs)] == [context] * 2
    assert set(llm.core.runner.decode.graphs) == before


def test_warmup_with_blocks_so_large_that_tables_are_narrower_than_the_narrowest_width(tiny, monkeypatch):
    """Blocks of 128 tokens: a table of the 512-token model holds at most 4 blocks, fewer than the
    narrowest width (8), so every decode shape has width 4; the warm-up captures exactly those."""
    llm = _capturing_llm(tiny, monkeypatch, max_num_seqs=1, block_size=128)
    assert {llm.core.runner.decode.bucket(1, w)[1] for w in range(1, 5)} == {4} and llm.core.runner.decode.widths() == [4]
    llm.warmup(512)
    before = set(llm.core.runner.decode.graphs)
    assert before
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=9, ignore_eos=True))
    assert set(llm.core.runner.decode.graphs) == before


def test_shapes_after_warmup_reuse_its_compiled_forward(tiny, monkeypatch):
    """The warm-up compiles the decode forward in the steps' inference mode: a shape first met
    by a request (here one asking for logprobs, which the warm-up does not capture) is captured
    without compiling the forward again (on CUDA an Inductor compile: seconds of a running load)."""
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", **kw))
    llm = _capturing_llm(tiny, monkeypatch, max_num_seqs=2, compile=True)
    llm.warmup(64)
    graphs, compiled = set(llm.core.runner.decode.graphs), counters["stats"]["unique_graphs"]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=9, ignore_eos=True, logprobs=0))[0]
    assert len(out.token_ids) == 9 and set(llm.core.runner.decode.graphs) > graphs
    assert counters["stats"]["unique_graphs"] == compiled


def test_decode_row_steps_count_no_padding_rows(tiny):
    """decode_row_steps counts the sub-steps of rows that compute: a row that ended (its
    max_tokens reached) becomes a padding row of the groups that go on, and is not counted."""
    llm = LLM(tiny, max_num_seqs=2)
    short, long = SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=30, ignore_eos=True)
    llm.generate([[5, 6, 7], [8, 9, 10]], [short, long])
    m = llm.metrics()
    # after the prefill step's first tokens the long row decodes 29 sub-steps; the short row
    # rides along the first group only (8 sub-steps: the long row's group size)
    assert m["decode_steps"] == 29
    assert m["decode_row_steps"] == 29 + 8


def test_a_shape_whose_capture_fails_runs_eagerly(tiny, prompts, reference, monkeypatch):
    """A decode shape whose compile or CUDA-graph capture fails runs uncaptured, with a warning
    and the reason in metrics; the output is unchanged."""
    import llmaccel.runtime.decode as decode
    import llmaccel.runtime.step_graphs as step_graphs

    def fail(fn, pool, device, reset=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode, "cuda_graph", fail)
    monkeypatch.setattr(step_graphs, "cuda_graph", fail)
    llm = LLM(tiny)
    llm.core.runner.decode.capture = True
    llm.core.runner.steps = step_graphs.StepGraphs(llm.core.runner.gm, llm.core.cache, scratch=llm.core.cache.num_blocks - 1,
                                       capture=True, pool=object(),  # no CUDA pool on a CPU
                                       max_seqs=8)
    with pytest.warns(UserWarning, match="run eagerly"):
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    m = llm.metrics()
    assert m["graphs_captured"] == 0 and m["decode_steps"] > 0 and m["step_graph_replays"] == 0
    assert any(len(k) == 3 for k in m["graph_failures"])  # a step shape (tokens, seqs, width)
    assert all("not permitted" in why for why in m["graph_failures"].values())


@pytest.mark.parametrize("kw", [
    {},
    {"kv_cache_tokens": 96, "block_size": 8},  # preemption: prefills again over cached blocks
    {"kv_cache_tokens": 120, "block_size": 3, "max_num_batched_tokens": 16},  # chunks, mixed steps
    {"speculative": "ngram"},  # verification steps stay eager, decode steps of rows without a match do not
], ids=["batched", "preempt", "chunked", "ngram"])
def test_small_steps_on_static_buffers_match_reference(tiny, prompts, reference, kw):
    """The padded bucket steps of step_graphs (run eagerly here, replayed as CUDA graphs on a
    GPU): the same tokens as the reference executor, sampled rows too, with the KV cache left
    as the eager steps leave it."""
    from llmaccel.runtime.step_graphs import StepGraphs

    llm = LLM(tiny, **kw)
    llm.core.runner.steps = StepGraphs(llm.core.runner.gm, llm.core.cache, scratch=llm.core.cache.num_blocks - 1, capture=False,
                           max_tokens=128, max_seqs=8)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    shapes = set(llm.core.runner.steps.graphs)
    assert shapes and all(N <= 128 and S in (1, 2, 4, 8) for N, S, _ in shapes)
    assert llm.metrics()["kv_blocks_used"] == 0
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=5)
    plain = LLM(tiny, **kw)
    want = [o.token_ids for o in plain.generate(prompts, sampled)]
    assert [o.token_ids for o in llm.generate(prompts, sampled)] == want


def test_step_buckets():
    """Tokens to 16 * 2^k, sequences to 1/2/4/8 with room for the padding sequence, width to a
    power of two covering the padding sequence's context; large or verification steps: none."""
    from llmaccel.runtime.kv_cache import PagedKVCache
    from llmaccel.runtime.step_graphs import StepGraphs

    cache = PagedKVCache({0: (1, 4)}, 64, 16, torch.float32, "cpu")
    sg = StepGraphs(None, cache, scratch=63, capture=False, max_tokens=512, max_seqs=8)
    assert sg.shape([([0] * 8, 0, [1] * 128)], [1]) == (128, 1, 8)
    assert sg.shape([([0] * 8, 0, [1] * 100)], [1]) == (128, 2, 8)
    assert sg.shape([([0] * 40, 600, [1])] * 3 + [([0] * 2, 0, [1] * 20)], [1] * 4) == (32, 8, 64)
    assert sg.shape([([0] * 40, 0, [1] * 513)], [1]) is None
    assert sg.shape([([0] * 8, 0, [1] * 10)], [3]) is None
    assert sg.shape([([0] * 8, 0, [1])] * 9, [1] * 9) is None
    lone = StepGraphs(None, cache, scratch=63, capture=False)  # the default: one sequence
    assert lone.shape([([0] * 8, 0, [1] * 100)], [1]) == (128, 2, 8)
    assert lone.shape([([0] * 8, 0, [1] * 10)] * 2, [1, 1]) is None


def test_step_graphs_stop_capturing_past_their_cap(tiny, prompts, reference):
    """Past max_graphs shapes, steps of a new shape run eagerly (no capture storm under a
    server's varied steps); the tokens are the reference's either way."""
    from llmaccel.runtime.step_graphs import StepGraphs

    llm = LLM(tiny)
    llm.core.runner.steps = StepGraphs(llm.core.runner.gm, llm.core.cache, scratch=llm.core.cache.num_blocks - 1, capture=False,
                           max_graphs=2)
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == reference
    assert len(llm.core.runner.steps.graphs) == 2


def test_warm_eager_steps_stay_within_the_context(tiny):
    """The warm-up's mixed steps never pass `context` positions (a model with a short position
    table): a decode row at the context's end beside prompts cut to it."""
    from llmaccel.runtime.warmup import eager_warm_steps, warm_eager_steps

    llm = LLM(tiny)
    scratch = llm.core.cache.num_blocks - 1
    assert warm_eager_steps(llm.core.runner.gm, llm.core.cache, scratch, 12) == 2    # prompts of 8 and 12
    assert warm_eager_steps(llm.core.runner.gm, llm.core.cache, scratch, 500) == 2 * 3  # rows at 256 and 500
    for context in (1, 12, 256, 300, 512):
        steps = eager_warm_steps(context)
        assert max(L for L, _ in steps) == context and all(0 < p <= context for _, p in steps)


def test_warmup_leaves_the_sequences_kv_alone(tiny, monkeypatch):
    """The warm-up's steps write the scratch block only: blocks of a finished request (kept by
    the prefix cache) are unchanged, with blocks of 4 tokens in a cache of few blocks, and a
    request reusing that prefix still gives the reference executor's tokens."""
    llm = _capturing_llm(tiny, monkeypatch, max_num_seqs=2, block_size=4, kv_cache_tokens=32)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))
    s = llm.core.cache.num_blocks - 1
    before = [t[:s].clone() for t in (*llm.core.cache.k.values(), *llm.core.cache.v.values())]
    warm = llm.warmup(512)
    assert warm["shapes"] > 0 and llm.metrics()["graphs_captured"] < warm["shapes"]  # mixed steps ran
    after = [t[:s] for t in (*llm.core.cache.k.values(), *llm.core.cache.v.values())]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    out = llm.generate([prompt], GREEDY)[0].token_ids
    assert out == list(tiny.generate_ids(prompt, GREEDY)) and llm.metrics()["prefix_cache_hit_tokens"] > 0
