"""Eager steps whose tokens are read one step late (runtime/eager_steps.py): failures in the
middle of a step lose no token and leave no request stuck, and the step launched before the held
tokens are read does not wait for the device."""
import logging
import time
import types

import pytest
import torch

from llmaccel import LLM, SamplingParams
from llmaccel.serve.loop import EngineLoop, _Choice


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 7, 33, 25, 12, 48, 3, 19)]


def _drain(llm, limit=60):
    for _ in range(limit):
        if not llm.has_unfinished():
            return
        llm.step()
    raise AssertionError("the engine did not finish its requests")


def _held_engine(tiny, prompts, params):
    """An engine after one step over three short prompts: one held step whose tokens are those
    three requests' first ones."""
    llm = LLM(tiny, max_num_batched_tokens=64)
    ps = [prompts[1], prompts[4], prompts[6]]  # 7 + 12 + 3 tokens: one prefill step
    seqs = [llm.add_request(p, params) for p in ps]
    llm.step()
    held = llm.core.eager.held
    assert held is not None and [s.id for s in held.waiting] == [s.id for s in seqs]
    return llm, ps, seqs


def _failing_append(llm, nth):
    real, calls = llm.core.append, []

    def flaky(seq, toks, lps=None):
        calls.append(seq)
        if len(calls) == nth:
            raise RuntimeError("injected")
        return real(seq, toks, lps)
    llm.core.append = flaky
    return real, calls


def test_a_failure_in_the_held_bookkeeping_leaves_the_other_rows_going_on(tiny, prompts):
    """As for decode groups (test_decode_pipeline.py): when one row's bookkeeping fails, the
    caller fails that request and the others go on to the reference's tokens (their KV counts
    as computed since the launch, so each must still get its token)."""
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    llm, ps, seqs = _held_engine(tiny, prompts, params)
    real, calls = _failing_append(llm, 1)  # the first row read
    with pytest.raises(RuntimeError, match="injected"):
        llm.step()
    llm.core.append = real
    llm.abort(calls[0])  # the request whose bookkeeping failed
    _drain(llm)
    for s, p in zip(seqs, ps):
        if s is not calls[0]:
            assert s.output_ids == list(tiny.generate_ids(p, params))
    assert llm.metrics()["kv_blocks_used"] == 0


def test_the_server_loop_recovers_from_a_failure_in_the_held_bookkeeping(tiny, prompts, caplog):
    """EngineLoop fails the requests still running after a failed step. A row that ended (EOS)
    before the failing row must be handed to Scheduler.finish all the same, or it keeps its
    blocks and its place in `running`, has_unfinished() stays true and the loop spins."""
    params = SamplingParams(max_tokens=5)
    first = [list(tiny.generate_ids(p, SamplingParams(max_tokens=1, ignore_eos=True)))[0]
             for p in (prompts[1], prompts[4], prompts[6])]
    assert first[0] not in first[1:]
    llm, ps, seqs = _held_engine(tiny, prompts, params)
    llm.core.eos = {first[0]}  # the first row ends on its held token

    class Out:
        def __init__(self):
            self.items = []

        def route(self, job, item):
            self.items.append(item)

        def flush(self):
            pass

        def record(self, kind, value):
            pass

        def publish(self, figures):
            pass

    core = EngineLoop(llm, None, Out())
    for s in seqs:  # the requests as the loop holds them
        job = types.SimpleNamespace(prompts=[s.token_ids], params=[params], t0=time.perf_counter())
        core._choices.append(_Choice(job, 0, s))
    real, _ = _failing_append(llm, 2)  # the second row read: the first has ended by then
    with caplog.at_level(logging.CRITICAL, logger="llmaccel.serve"):
        core._step()
        llm.core.append = real
        core._emit()
        assert seqs[0].finish_reason == "stop" and not core._choices
        for _ in range(3):  # what the loop does next while has_unfinished()
            if llm.has_unfinished():
                core._step()
    assert not llm.has_unfinished()
    assert llm.metrics()["kv_blocks_used"] == 0


def test_a_failure_after_a_held_step_is_launched_loses_no_tokens(tiny, prompts):
    """When holding a step fails (on CUDA it allocates pinned memory and records an event),
    no host state has moved yet: the sequences are scheduled again and end as the reference."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(tiny, max_num_batched_tokens=64)
    ps = [prompts[1], prompts[4], prompts[6]]
    seqs = [llm.add_request(p, params) for p in ps]
    hold, n = llm.core.eager._hold, []

    def flaky(*a):
        n.append(1)
        if len(n) == 1:
            raise RuntimeError("injected")
        return hold(*a)
    llm.core.eager._hold = flaky
    with pytest.raises(RuntimeError, match="injected"):
        llm.step()
    _drain(llm)
    for s, p in zip(seqs, ps):
        assert s.output_ids == list(tiny.generate_ids(p, params))
    assert llm.metrics()["kv_blocks_used"] == 0


def test_the_step_launched_before_the_held_tokens_are_read_does_not_wait_for_the_device(
        tiny, prompts, monkeypatch):
    """Between a step's launch and the read of the held step (_apply), the host must not wait
    for the device, or the GPU is idle during the bookkeeping meant to overlap it: no
    torch.tensor(list, device=dev), which on CUDA is a copy and a stream sync (seen here as
    the call; the inputs go through .to(dev, non_blocking=True))."""
    import llmaccel.runtime.eager_steps as es

    window, blocking = [False], []

    class Torch:  # torch as eager_steps sees it, noting blocking host-to-device copies
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def tensor(data, *a, **k):
            if k.get("device") is not None and window[0]:
                blocking.append(data)
            return torch.tensor(data, *a, **k)

    monkeypatch.setattr(es, "torch", Torch())
    llm = LLM(tiny, max_num_batched_tokens=32)
    eager_step, apply = llm.core.eager.run, llm.core.eager.apply

    def step_beside(plan, proposals, held=None):
        window[0] = held is not None  # from its launch to the read of `held`
        return eager_step(plan, proposals, held)

    def read(held):
        window[0] = False
        return apply(held)
    llm.core.eager.run, llm.core.eager.apply = step_beside, read
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompts[:5], params)
    assert [o.token_ids for o in outs] == [list(tiny.generate_ids(p, params)) for p in prompts[:5]]
    assert llm.metrics()["eager_steps"] > 1 and blocking == []


def test_a_failed_verification_leaves_a_separate_draft_able_to_propose(tiny, prompts):
    """A draft with a cache of its own counts the proposals it fed; when the verification
    forward fails, the next proposal starts again from the sequence's last token."""
    llm = LLM(tiny, speculative="preset:tiny-llama", num_speculative_tokens=2)
    assert llm.core.draft.cache is not llm.core.cache
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ps = [prompts[1], prompts[4]]
    seqs = [llm.add_request(p, params) for p in ps]
    forward, failed = llm.core.runner.forward, []

    def flaky(plan):
        if not failed and any(nl > 1 for _, _, nl in plan):  # a step verifying proposals
            failed.append(1)
            raise RuntimeError("injected")
        return forward(plan)
    llm.core.runner.forward = flaky
    with pytest.raises(RuntimeError, match="injected"):
        _drain(llm)
    _drain(llm)
    assert failed
    for s, p in zip(seqs, ps):
        assert s.output_ids == list(tiny.generate_ids(p, params))
    assert llm.metrics()["spec_proposed"] > 0 and llm.metrics()["kv_blocks_used"] == 0
