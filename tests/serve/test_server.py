"""`llmc serve preset:tiny-llama` as a subprocess, driven by the real openai client and the
load test. The preset has no tokenizer: prompts are token ids, texts are empty."""
import asyncio
import signal

import httpx
import openai
import pytest

from llmaccel.serve.loadtest import LoadConfig, LoadTest, serve_subprocess

KEY = "k-123"
MODEL = "preset:tiny-llama"
CTX = 512  # tiny-llama's context


@pytest.fixture(scope="module")
def server():
    with serve_subprocess(MODEL, "--api-key", KEY, "--max-waiting", "256", "--shutdown-timeout", "20",
                          "--log-level", "warning", timeout=60) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


def test_completions_with_the_openai_client(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=7, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True, "a_field_from_the_future": {"x": 1}})
    (c,) = r.choices
    assert c.finish_reason == "length" and r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 7
    assert len(c.logprobs.tokens) == 7 and all(len(t) <= 3 for t in c.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    # greedy is deterministic; n seeded choices are reproducible
    again = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=7, temperature=0,
                                      logprobs=3, extra_body={"ignore_eos": True})
    assert again.choices[0].logprobs.tokens == c.logprobs.tokens
    two = [client.completions.create(model=MODEL, prompt=[[5, 6], [7, 8, 9]], n=2, max_tokens=5, seed=3,
                                     temperature=1.0, logprobs=0, extra_body={"ignore_eos": True})
           for _ in range(2)]
    assert [ch.index for ch in two[0].choices] == [0, 1, 2, 3]
    assert two[0].usage.prompt_tokens == 5 and two[0].usage.completion_tokens == 20
    assert [ch.logprobs.tokens for ch in two[0].choices] == [ch.logprobs.tokens for ch in two[1].choices]


def test_streaming_with_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt=[3, 1, 4, 1, 5], max_tokens=20, n=2,
                                            temperature=0.7, seed=1, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 40 and last.usage.prompt_tokens == 5
    finishes = [(ch.index, ch.finish_reason) for c in body for ch in c.choices if ch.finish_reason]
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    assert len({c.id for c in chunks}) == 1
    # the tokens arrive over several chunks (a step appends up to 8 decode tokens)
    assert sum(1 for c in body for ch in c.choices if ch.index == 0) >= 3


@pytest.mark.parametrize("kw, cls, words", [
    (dict(temperature=-1), openai.BadRequestError, "temperature"),
    (dict(top_p=1.5), openai.BadRequestError, "top_p"),
    (dict(top_p=0), openai.BadRequestError, "top_p"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(prompt=[1] * CTX), openai.BadRequestError, f"model context is {CTX}"),
    (dict(max_tokens=CTX), openai.BadRequestError, f"exceeds the model context of {CTX}"),
    (dict(prompt=[CTX + 5]), openai.BadRequestError, "outside the vocabulary"),
    (dict(prompt=[]), openai.BadRequestError, "empty"),
    (dict(prompt="text"), openai.BadRequestError, "no tokenizer"),
    (dict(stop=["x"]), openai.BadRequestError, "stop strings need a tokenizer"),
    (dict(extra_body={"logprobs": 21}), openai.BadRequestError, "logprobs"),
    (dict(extra_body={"temperature": "hot"}), openai.BadRequestError, "temperature"),
    (dict(extra_body={"top_k": 10**20}), openai.BadRequestError, "top_k"),
    (dict(model="gpt-4"), openai.NotFoundError, "does not exist"),
])
def test_bad_requests_get_openai_errors(client, kw, cls, words):
    args = dict(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
    args.update(kw)
    with pytest.raises(cls) as e:
        client.completions.create(**args)
    assert words in e.value.body["message"] and e.value.body["type"]


def test_auth_json_and_chat_errors(server, client):
    url = server[0]
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    hdr = {"authorization": f"Bearer {KEY}"}
    for body, status in ((b'{"model": "x", "prompt": [1', 400), (b'[1, 2]', 400),
                         (b'{"model": "preset:tiny-llama"}', 400)):
        r = httpx.post(f"{url}/v1/completions", content=body, headers=hdr)
        assert r.status_code == status and r.json()["error"]["message"], r.text
    assert httpx.get(f"{url}/v1/nothing", headers=hdr).status_code == 404
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    # the server is still healthy after all of that
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_load_with_disconnects_and_bad_requests(server):
    # the goal's load: 1,000 requests at concurrency 200 (~4 s of load on 2 CPU cores)
    cfg = LoadConfig(url=server[0], requests=1000, concurrency=200, cancel_frac=0.1, bad_frac=0.05,
                     prompt_len=(4, 16), max_tokens=(4, 16), api_key=KEY, seed=7)
    res = asyncio.run(LoadTest(cfg).run())
    assert res["ok"], (res["checks"], res["problems"])
    assert res["requests"]["cancel"] > 10 and res["requests"]["bad"] > 5
    assert res["kv_blocks_used_after"] == 0
    # the figures that say who set the pace: the engine's steps and time in them during the
    # run (from /metrics), the client's CPU time, the time to each response's headers
    eng = res["engine"]
    assert eng["steps"] > 0 and 0 < eng["busy_s"] <= res["wall_s"] + 1.0
    assert eng["graphs_captured"] == 0  # a CPU engine captures none
    assert "llmaccel_cuda_graphs_captured_total 0.0" in httpx.get(f"{server[0]}/metrics").text
    assert 0 < res["client_cpu_s"] and 0 < res["accepted_s"]["p50"] <= res["ttft_s"]["p50"]


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_the_server_with_a_quiet_stderr(tmp_path, inherited):
    """Both processes freeze what they loaded out of the collector's way; unfrozen before exit,
    nothing of triton outlives its module, so nanobind prints no "leaked ..." lines. Started
    with SIGINT ignored (as a script's background job is), SIGINT still ends it with 130."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if inherited == "ignored" else signal.default_int_handler)
    try:
        with open(tmp_path / "err", "w+") as err:
            with serve_subprocess(MODEL, "--warmup-context", "0", timeout=60, stderr=err) as (url, proc):
                signal.signal(signal.SIGINT, before)
                assert httpx.get(f"{url}/health").status_code == 200
                proc.send_signal(signal.SIGINT)
                assert proc.wait(30) == 130
            err.seek(0)
            text = err.read()
    finally:
        signal.signal(signal.SIGINT, before)
    assert "Application shutdown complete" in text and "nanobind" not in text and "leaked" not in text


def test_sigterm_finishes_the_stream_in_flight_and_exits_0(server):
    """Last in this module: it stops the module's server."""
    url, proc = server
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    stream = c.completions.create(model=MODEL, prompt=[1, 2], max_tokens=100, temperature=0,
                                  stream=True, stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True})
    first = next(stream)  # the request is running
    proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert first.choices and rest[-1].usage.completion_tokens == 100
    assert proc.wait(30) == 0
    with pytest.raises(httpx.ConnectError):  # no longer admitting
        httpx.get(f"{url}/health")
