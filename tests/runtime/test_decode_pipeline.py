"""Decode groups launched before the last one's bookkeeping (LLM._continue, DecodeRunner.relaunch):
the next group starts from the device state of the one before while the host applies its
tokens. Checked against the reference executor and against each request run alone: the same
tokens whatever ends within a group (max_tokens, EOS, a stop, an abort), every block freed."""
import pytest
import torch

from llmaccel import LLM, SamplingParams
from llmaccel.runtime.decode import DecodeRunner
from tests.runtime.conftest import check_logprobs


@pytest.fixture(autouse=True, params=[False, True], ids=["launch-after-collect", "launch-before-collect"])
def early(request, monkeypatch):
    """Every test both ways: the next group launched after the host read the last one's
    tokens (eager sub-steps, the CPU), and before (`early`: CUDA graphs), the outputs then
    read from their host copies."""
    init = DecodeRunner.__init__

    def with_early(self, *a, **kw):
        init(self, *a, **kw)
        self.early = request.param
    monkeypatch.setattr(DecodeRunner, "__init__", with_early)
    return request.param


def test_early_launches_the_next_group_before_reading_the_last(tiny, prompts, early):
    llm = LLM(tiny, max_num_seqs=8)
    r, log = llm.core.runner.decode, []
    collect, relaunch = r.collect, r.relaunch
    r.collect = lambda grp: (log.append(("collect", id(grp))), collect(grp))[1]

    def logged(grp, *a):
        nxt = relaunch(grp, *a)
        log.append(("relaunch", id(grp)))
        return nxt
    r.relaunch = logged
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    outs = llm.generate(prompts[:3], params)
    pairs = [(log.index(("relaunch", g)), log.index(("collect", g))) for kind, g in log if kind == "relaunch"]
    assert pairs and all((a < b) == early for a, b in pairs)
    for p, o in zip(prompts[:3], outs):
        assert o.token_ids == list(tiny.generate_ids(p, params))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 9, 21, 2, 30, 14, 6)]


def test_pipelined_groups_match_the_reference_with_rows_ending_inside_groups(tiny, prompts):
    # max_tokens 5..41: rows end inside a group, the others go on in the relaunched ones
    params = [SamplingParams(max_tokens=5 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    llm = LLM(tiny, max_num_seqs=8)
    outs = llm.generate(prompts, params)
    assert llm.core.runner.decode.relaunches > 0
    for p, sp, o in zip(prompts, params, outs):
        assert o.token_ids == list(tiny.generate_ids(p, sp))
    assert llm.metrics()["kv_blocks_used"] == 0


def test_seeded_sampled_rows_give_their_tokens_alone_or_in_a_pipelined_batch(tiny, prompts):
    params = [SamplingParams(max_tokens=7 + 5 * i, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i,
                             ignore_eos=True) for i in range(len(prompts))]
    llm = LLM(tiny, max_num_seqs=8)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.core.runner.decode.relaunches > 0
    alone = [LLM(tiny, max_num_seqs=1).generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone


def test_an_eos_inside_a_group_ends_the_row_and_the_pipeline_drops_its_extra_tokens(tiny, prompts):
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    refs = [list(tiny.generate_ids(p, long)) for p in prompts]
    # an EOS that one row first meets in its second group (after 8 tokens): it ends there while
    # its next group is already launched; the rows without it decode on
    eos = next(r[i] for r in refs for i in range(9, 16) if r[i] not in r[:i])
    llm = LLM(tiny, max_num_seqs=8)
    llm.core.eos = {eos}
    outs = llm.generate(prompts, SamplingParams(max_tokens=30))
    assert llm.core.runner.decode.relaunches > 0
    for r, o in zip(refs, outs):
        cut = r.index(eos) if eos in r else len(r)
        assert o.token_ids == r[:cut] and o.finish_reason == ("stop" if eos in r else "length")
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    assert llm.metrics()["kv_blocks_used"] == 0


def test_abort_and_new_requests_between_pipelined_steps(tiny, prompts):
    llm = LLM(tiny, max_num_seqs=8)
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    seqs = [llm.add_request(p, long) for p in prompts[:4]]
    for _ in range(4):
        llm.step()
    assert llm.core.decode.pending is not None  # a group is in flight between steps
    llm.abort(seqs[0])  # its blocks are freed now; the group in flight drops its row
    late = llm.add_request(prompts[5], long)  # admitted once the group in flight is resolved
    while llm.has_unfinished():
        llm.step()
    assert seqs[0].finish_reason == "abort"
    for s, p in zip(seqs[1:] + [late], prompts[1:4] + [prompts[5]]):
        assert s.output_ids == list(tiny.generate_ids(p, long))
    llm.step()  # resolves a group left in flight, if any
    assert llm.metrics()["kv_blocks_used"] == 0


def test_a_saturated_engine_keeps_its_groups_overlapped(tiny, prompts):
    # two slots, four requests: the waiting ones cannot be admitted until a row ends
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    llm = LLM(tiny, max_num_seqs=2)
    outs = llm.generate(prompts[:4], params)
    assert llm.core.runner.decode.relaunches >= llm.core.runner.decode.launches
    for p, o in zip(prompts[:4], outs):
        assert o.token_ids == list(tiny.generate_ids(p, params))


def test_a_group_left_in_flight_costs_the_next_request_no_step(tiny, prompts):
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    refs = [list(tiny.generate_ids(p, long)) for p in prompts[:3]]
    llm = LLM(tiny, max_num_seqs=4)
    llm.core.eos = {r[9] for r in refs}  # every row ends by an EOS in its second group
    llm.generate(prompts[:3], SamplingParams(max_tokens=30))
    steps = llm.metrics()["steps"]
    out = llm.generate([prompts[4]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert llm.metrics()["steps"] == steps + 1  # the group left in flight resolved in that step
    assert out.token_ids == list(tiny.generate_ids(prompts[4], SamplingParams(max_tokens=1, ignore_eos=True)))


def test_a_failure_in_the_bookkeeping_does_not_leave_a_group_running_ahead(tiny, prompts):
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    llm = LLM(tiny, max_num_seqs=8)
    seqs = [llm.add_request(p, long) for p in prompts[:4]]
    real, calls = llm.core.append, []

    def flaky(seq, toks, lps=None):
        calls.append(1)
        if len(calls) == 6:  # the second row of a decode group
            raise RuntimeError("injected")
        return real(seq, toks, lps)
    llm.core.append = flaky
    with pytest.raises(RuntimeError, match="injected"):
        while llm.has_unfinished():
            llm.step()
    assert llm.core.decode.pending is None  # nothing launched from tokens that were not applied
    llm.core.append = real
    llm.abort(seqs[1])  # the row whose bookkeeping failed (a server fails its request)
    while llm.has_unfinished():
        llm.step()
    # the rows after it, whose tokens were not applied, go on from their host state
    for s, p in zip(seqs[:1] + seqs[2:], prompts[:1] + prompts[2:4]):
        assert s.output_ids == list(tiny.generate_ids(p, long))


@pytest.mark.parametrize("top", [0, 3])
def test_pipelined_logprobs_follow_the_reference_logits(tiny, prompts, top):
    p = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=top)
    llm = LLM(tiny, max_num_seqs=4)
    outs = llm.generate(prompts[:3], p)
    assert llm.core.runner.decode.relaunches > 0
    check_logprobs(tiny, prompts[:3], outs, top=top, n=20)


@pytest.mark.cuda
def test_on_the_gpu_pipelined_graph_groups_match_the_reference(prompts, early):
    """CUDA graphs (fp32: no greedy ties): rows ending inside groups by max_tokens and by an
    EOS, and seeded sampled rows, alone or batched, read from the host copies of their groups."""
    from llmaccel import load

    if not early:
        pytest.skip("with CUDA graphs the engine always launches early")

    m = load("preset:tiny-llama", dtype=torch.float32, device="cuda")
    params = [SamplingParams(max_tokens=5 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    llm = LLM(m, max_num_seqs=8)
    assert llm.core.runner.decode.capture and llm.core.runner.decode.early
    refs = [list(m.generate_ids(p, SamplingParams(max_tokens=41, ignore_eos=True))) for p in prompts]
    outs = llm.generate(prompts, params)
    assert llm.core.runner.decode.relaunches > 0 and llm.metrics()["graph_steps"] > 0
    assert [o.token_ids for o in outs] == [r[:sp.max_tokens] for r, sp in zip(refs, params)]
    eos = next(r[i] for r in refs for i in range(9, 16) if r[i] not in r[:i])
    llm.core.eos = {eos}
    outs = llm.generate(prompts, SamplingParams(max_tokens=30))
    for r, o in zip(refs, outs):
        cut = min(r.index(eos) if eos in r else 30, 30)
        assert o.token_ids == r[:cut]
    llm.core.eos = set()
    sampled = [SamplingParams(max_tokens=7 + 5 * i, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
               for i in range(len(prompts))]
    together = [o.token_ids for o in llm.generate(prompts, sampled)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, sampled)]
    assert together == alone
    assert llm.metrics()["kv_blocks_used"] == 0
