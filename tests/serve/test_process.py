"""EngineProcess, the engine loop in a process of its own (what `llmc serve` runs): a job's
events cross the pipe intact, a model that cannot load is one clear error, and an engine
process that dies fails what was in flight with 500 and turns /health's `alive` off."""
import asyncio
import os
import signal
import time

import pytest

from llmaccel.errors import LlmaccelError
from llmaccel.sampling import SamplingParams
from llmaccel.serve.loop import ACCEPTED, Delta, Job, ServeError
from llmaccel.serve.process import EngineProcess

TINY = dict(source="preset:tiny-llama", device="cpu", dtype="float32", kv_cache_tokens=4096)


async def _events(eng, job: Job, until) -> list:
    eng.submit(job)
    out = []
    while not until(out):
        out.append(await asyncio.wait_for(job.events.get(), 30))
    return out


def test_a_job_runs_in_the_engine_process_and_the_figures_come_back():
    eng = EngineProcess(**TINY)
    eng.start()
    try:
        async def run():
            job = Job([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=5, ignore_eos=True),
                                            SamplingParams(max_tokens=3, ignore_eos=True)])
            return await _events(eng, job, lambda ev: sum(isinstance(e, Delta) and e.finish_reason is not None
                                                          for e in ev) == 2)
        ev = asyncio.run(run())
        assert ev[0] == ACCEPTED
        toks = {0: [], 1: []}
        for d in ev[1:]:
            toks[d.index] += d.token_ids
        assert [len(toks[0]), len(toks[1])] == [5, 3]
        deadline = time.monotonic() + 10
        while eng.snapshot.get("kv_blocks_used", -1) != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.snapshot["kv_blocks_used"] == 0 and eng.snapshot["waiting"] == 0
        assert eng.alive
    finally:
        eng.shutdown()
    assert not eng.alive


def test_a_model_that_cannot_load_is_one_clear_error():
    with pytest.raises(LlmaccelError, match="nope"):
        EngineProcess(source="preset:nope", device="cpu")


def test_a_dead_engine_process_fails_its_jobs_with_500():
    eng = EngineProcess(**TINY)
    eng.start()
    try:
        async def run():
            job = Job([[1, 2, 3]], [SamplingParams(max_tokens=1000, ignore_eos=True)])
            eng.submit(job)
            assert await asyncio.wait_for(job.events.get(), 30) == ACCEPTED
            os.kill(eng.pid, signal.SIGKILL)
            while True:
                e = await asyncio.wait_for(job.events.get(), 30)
                if not isinstance(e, Delta):
                    return e
        err = asyncio.run(run())
        assert isinstance(err, ServeError) and err.status == 500 and "exited" in err.message
        assert not eng.alive
    finally:
        eng.shutdown()


def test_an_abort_after_one_choice_ended_stops_the_others_and_frees_their_blocks():
    eng = EngineProcess(**TINY)
    eng.start()
    try:
        async def run():
            job = Job([[1, 2, 3], [1, 2, 3]], [SamplingParams(max_tokens=1, ignore_eos=True),
                                                SamplingParams(max_tokens=900, ignore_eos=True)])
            await _events(eng, job, lambda ev: any(isinstance(e, Delta) and e.index == 0 and e.finish_reason
                                                   for e in ev))
            eng.abort(job)
        asyncio.run(run())
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (eng.snapshot.get("kv_blocks_used") or eng.snapshot.get("running")):
            time.sleep(0.05)
        assert eng.snapshot["kv_blocks_used"] == 0 and eng.snapshot["running"] == 0, eng.snapshot
        assert eng.snapshot["waiting"] == 0
    finally:
        eng.shutdown()


def test_a_burst_submitted_at_once_is_accepted_and_completed_exactly_once():
    # 64 jobs in one event-loop turn cross the pipe together and come back as tuples: each
    # gets one ACCEPTED first, then its choices' tokens in order, one finish per choice
    eng = EngineProcess(**TINY, max_num_seqs=32)
    eng.start()
    try:
        async def run():
            jobs = [Job([[1 + i % 7, 2, 3]] * (1 + i % 2),
                        [SamplingParams(max_tokens=4 + i % 5, ignore_eos=True, temperature=0)] * (1 + i % 2))
                    for i in range(64)]
            for job in jobs:
                eng.submit(job)

            async def events(job):
                out = []
                while sum(isinstance(e, Delta) and e.finish_reason is not None for e in out) < len(job.prompts):
                    out.append(await asyncio.wait_for(job.events.get(), 60))
                    assert not isinstance(out[-1], ServeError), out[-1]
                return out
            return jobs, await asyncio.gather(*(events(j) for j in jobs))
        jobs, evs = asyncio.run(run())
        for job, ev in zip(jobs, evs):
            assert ev[0] == ACCEPTED and ev.count(ACCEPTED) == 1
            for i, p in enumerate(job.params):
                mine = [d for d in ev[1:] if d.index == i]
                assert sum(len(d.token_ids) for d in mine) == p.max_tokens
                assert [d.finish_reason for d in mine if d.finish_reason] == ["length"]
                assert mine[-1].finish_reason == "length"
        # equal prompts and greedy sampling: equal outputs, whichever turn each choice ran in
        first = {}
        for job, ev in zip(jobs, evs):
            toks = [t for d in ev[1:] if d.index == 0 for t in d.token_ids]
            key = tuple(job.prompts[0])
            ref = first.setdefault(key, toks)
            n = min(len(ref), len(toks))
            assert toks[:n] == ref[:n]
        deadline = time.monotonic() + 10
        while eng.snapshot.get("kv_blocks_used", -1) != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.snapshot["kv_blocks_used"] == 0 and eng.snapshot["waiting"] == 0
    finally:
        eng.shutdown()


def test_a_tensor_parallel_engine_serves_the_tokens_of_one_process():
    """`llmc serve --tp 2`: the engine process (not a daemon: it starts its workers) gives the
    single-process engine's greedy tokens, and shutdown ends it and its workers."""
    from llmaccel import LLM

    prompt, p = [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True)
    want = LLM("preset:tiny-llama", device="cpu", kv_cache_tokens=4096).generate([prompt], p)[0].token_ids
    eng = EngineProcess(**TINY, tensor_parallel_size=2)
    eng.start()
    try:
        async def run():
            return await _events(eng, Job([prompt], [p]),
                                 lambda ev: any(isinstance(e, Delta) and e.finish_reason for e in ev))
        ev = asyncio.run(run())
        assert [t for d in ev[1:] for t in d.token_ids] == want
    finally:
        eng.shutdown()
    assert not eng.alive
