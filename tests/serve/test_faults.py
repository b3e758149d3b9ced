"""Faults inside the server, on the app served from a thread of this process: a failing engine
step, a dead engine loop, a full queue, clients that go away."""
import asyncio
import json
import time

import httpx
import pytest

from llmaccel import LLM
from tests.serve.conftest import serve_thread


@pytest.fixture(scope="module")
def llm():
    return LLM("preset:tiny-llama", max_num_seqs=2)


def body(**kw):
    return {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True, **kw}


def idle(srv, timeout=5.0) -> dict:
    """The loop's snapshot once nothing runs, waits or holds KV blocks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = srv.loop.snapshot
        if snap["running"] == snap["waiting"] == snap["kv_blocks_used"] == 0:
            return snap
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {srv.loop.snapshot}")


def test_a_failing_step_fails_its_requests_with_500_and_the_server_goes_on(llm, monkeypatch):
    real_step, calls = llm.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        real_step()

    monkeypatch.setattr(llm, "step", flaky_step)
    with serve_thread(llm) as (url, srv):
        r = httpx.post(f"{url}/v1/completions", json=body(max_tokens=50), timeout=30)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        # streamed: the 200 has gone out, so the failure comes as an error event
        calls.clear()
        with httpx.stream("POST", f"{url}/v1/completions", json=body(max_tokens=50, stream=True),
                          timeout=30) as s:
            events = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert "injected fault" in events[-2] and events[-1] == "data: [DONE]"
        idle(srv)
        ok = httpx.post(f"{url}/v1/completions", json=body(), timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{url}/health").status_code == 200
        m = httpx.get(f"{url}/metrics").text
        assert 'llmaccel_requests_total{status="500"} 1.0' in m
        assert 'llmaccel_sequences_finished_total{reason="error"} 2.0' in m


def test_health_is_503_when_the_loop_died(llm, monkeypatch):
    with serve_thread(llm) as (url, srv):
        monkeypatch.setattr(llm, "metrics", lambda: 1 / 0)  # the loop's own bookkeeping breaks
        r = httpx.post(f"{url}/v1/completions", json=body(), timeout=30)
        assert r.status_code == 500 and "engine loop died" in r.json()["error"]["message"]
        h = httpx.get(f"{url}/health")
        assert h.status_code == 503 and "ZeroDivisionError" in h.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json=body()).status_code == 503


async def _burst(url, n, **kw):
    async with httpx.AsyncClient(timeout=60) as c:
        return await asyncio.gather(*(c.post(f"{url}/v1/completions", json=body(**kw)) for _ in range(n)))


def test_admission_control_answers_429_past_max_waiting(llm):
    # the engine runs 2 sequences at once; 3 more may wait; the rest of 12 get 429
    with serve_thread(llm, max_waiting=3) as (url, srv):
        rs = asyncio.run(_burst(url, 12, max_tokens=40))
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 429 in codes and set(codes) == {200, 429}, codes
        assert all(r.json()["usage"]["completion_tokens"] == 40 for r in rs if r.status_code == 200)
        err = next(r for r in rs if r.status_code == 429).json()["error"]
        assert err["type"] == "rate_limit_error" and "limit 3" in err["message"]
        # whatever the timing, the first three fit
        assert codes.count(200) >= 3
        idle(srv)


def test_a_client_that_disconnects_frees_its_blocks_at_once(llm):
    with serve_thread(llm) as (url, srv):
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json=body(max_tokens=400, stream=True)) as s:
            lines = s.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert json.loads(first[6:])["choices"]  # running: the stream has begun
        t0 = time.monotonic()
        idle(srv, timeout=2.0)
        assert time.monotonic() - t0 < 2.0
        m = httpx.get(f"{url}/metrics").text
        assert 'llmaccel_sequences_finished_total{reason="abort"} 1.0' in m
        # a non-streamed request whose client times out is aborted too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body(max_tokens=450), timeout=0.3)
        idle(srv, timeout=4.0)
        assert 'llmaccel_sequences_finished_total{reason="abort"} 2.0' in httpx.get(f"{url}/metrics").text


def test_bad_serve_options_exit_2_with_one_line(capsys):
    import socket

    from llmaccel.cli import main

    assert main(["serve", "preset:tiny-llama", "--port", "70000"]) == 2
    assert main(["serve", "preset:tiny-llama", "--max-waiting", "-1"]) == 2
    with socket.create_server(("127.0.0.1", 0)) as busy:
        assert main(["serve", "preset:tiny-llama", "--port", str(busy.getsockname()[1])]) == 2
    assert main(["serve", "preset:tiny-llama", "--warmup-context", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(e.startswith("llmc: error: ") for e in err), err
    assert "--port must be at most 65535" in err[0] and "cannot listen" in err[2]
    assert "--warmup-context must be at least 0" in err[3]


def test_shutdown_ends_what_is_left_after_the_grace_period_with_503(llm):
    # (SIGTERM calls close(grace=--shutdown-timeout); tests/serve/test_server.py sends one)
    with serve_thread(llm) as (url, srv):
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json=body(max_tokens=450, stream=True)) as s:
            lines = (ln for ln in s.iter_lines() if ln.startswith("data: "))
            assert json.loads(next(lines)[6:])["choices"]
            srv.loop.close(grace=0.2)
            rest = list(lines)
        assert "shut down before this request finished" in rest[-2] and rest[-1] == "data: [DONE]"
        r = httpx.post(f"{url}/v1/completions", json=body())
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        idle(srv)
