"""Eager steps read one step late (runtime/eager_steps.py): the next step is scheduled without
the sequences waiting for a step's tokens and launched before those tokens are read. Checked
against the reference executor (greedy and seeded sampling, EOS and max_tokens inside the
prefill phase, preemption, prefix caching, an abort of a waiting sequence) and for the order of
launch and read."""
import pytest
import torch

from llmaccel import LLM, SamplingParams


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 7, 33, 25, 12, 48, 3, 19)]


def _ref(tiny, prompts, params):
    return [list(tiny.generate_ids(p, sp)) for p, sp in zip(prompts, params)]


def test_the_next_step_is_launched_before_the_tokens_are_read(tiny, prompts):
    # 32 tokens a step: the prompts take several prefill steps, each sampling some rows
    llm = LLM(tiny, max_num_batched_tokens=32)
    order = []
    forward, apply = llm.core.runner.forward, llm.core.eager.apply
    llm.core.runner.forward = lambda plan: order.append("launch") or forward(plan)
    llm.core.eager.apply = lambda held: order.append("read") or apply(held)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == _ref(tiny, prompts, [params] * len(prompts))
    reads = [i for i, e in enumerate(order) if e == "read"]
    assert reads and any(order[i - 1] == "launch" for i in reads)  # read right after a launch
    assert llm.core.eager.held is None and llm.metrics()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kw", [
    {"max_num_batched_tokens": 24},
    {"max_num_batched_tokens": 40, "kv_cache_tokens": 96, "block_size": 8},  # preemption
    {"max_num_batched_tokens": 32, "max_num_seqs": 3},
    {"max_num_batched_tokens": 48, "enable_prefix_caching": True},
])
def test_outputs_equal_the_reference(tiny, prompts, kw):
    params = [SamplingParams(max_tokens=1 + (i % 4) * 5, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7 + i, ignore_eos=True)
              for i in range(len(prompts))]
    llm = LLM(tiny, **kw)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == _ref(tiny, prompts, params)
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.metrics()["kv_blocks_used"] == 0


def test_eos_on_the_first_token_ends_the_request(tiny, prompts):
    params = SamplingParams(max_tokens=8)
    first = [list(tiny.generate_ids(p, SamplingParams(max_tokens=1, ignore_eos=True)))[0] for p in prompts]
    llm = LLM(tiny, max_num_batched_tokens=32)
    llm.core.eos = {first[0], first[3]}  # the first token of two requests is their end
    outs = llm.generate(prompts, params)
    for i in (0, 3):
        assert outs[i].token_ids == [] and outs[i].finish_reason == "stop"
    assert llm.metrics()["kv_blocks_used"] == 0


def test_a_request_aborted_while_its_token_is_held(tiny, prompts):
    llm = LLM(tiny, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    seqs = [llm.add_request(p, params) for p in prompts[:4]]
    llm.step()
    held = llm.core.eager.held
    assert held is not None and held.waiting
    llm.abort(held.waiting[0])
    while llm.has_unfinished():
        llm.step()
    gone = held.waiting[0]
    assert gone.finish_reason == "abort"
    for s, p in zip(seqs, prompts[:4]):
        if s is not gone:
            assert s.output_ids == list(tiny.generate_ids(p, params))
    assert llm.metrics()["kv_blocks_used"] == 0


def test_a_failed_launch_still_reads_the_held_tokens(tiny, prompts):
    llm = LLM(tiny, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    seqs = [llm.add_request(p, params) for p in prompts[1:4]]  # the first prompt ends in step 1
    llm.step()
    held = llm.core.eager.held
    assert held is not None
    forward = llm.core.runner.forward

    def boom(plan):
        raise RuntimeError("launch failed")
    llm.core.runner.forward = boom
    with pytest.raises(RuntimeError, match="launch failed"):
        llm.step()
    assert llm.core.eager.held is None and all(s.n_output == 1 for s in held.waiting)
    llm.core.runner.forward = forward
    while llm.has_unfinished():
        llm.step()
    for s, p in zip(seqs, prompts[1:4]):
        assert s.output_ids == list(tiny.generate_ids(p, params))
