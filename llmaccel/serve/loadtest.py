"""Load and fault test of an OpenAI-compatible server (`llmc serve`), run against its URL:

    python -m llmaccel.serve.loadtest --url http://127.0.0.1:8000 --requests 1000 --concurrency 200 \\
        --rate inf --cancel-frac 0.1 --bad-frac 0.05
    python -m llmaccel.serve.loadtest --serve preset:tiny-llama     # starts and stops the server

Poisson arrivals at --rate requests/s (inf: all at once), at most --concurrency in flight, each a
streamed /v1/completions request of random token ids. A share of clients disconnect mid-stream,
a share send bad requests. Reports TTFT, TPOT, ITL percentiles, throughput and goodput, and
checks that every well-formed request completed exactly once with its max_tokens (or a stop),
bad ones got a 4xx error body, the server counted each request once, and afterwards the engine
holds no running or waiting sequence and no KV block (read from /metrics). Exit status 1 when a
check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from llmaccel.serve.metrics import STEP_COUNTERS


@dataclass
class LoadConfig:
    url: str
    requests: int = 1000
    concurrency: int = 200
    rate: float = float("inf")
    cancel_frac: float = 0.1
    bad_frac: float = 0.05
    prompt_len: tuple[int, int] = (16, 64)
    max_tokens: tuple[int, int] = (16, 64)
    vocab: int = 256  # prompt token ids are drawn from 1..vocab-1
    seed: int = 0
    api_key: str | None = None
    slo_ttft: float = 2.0  # goodput: requests with TTFT and TPOT (seconds) within these
    slo_tpot: float = 0.2
    settle_s: float = 10.0  # how long the engine may take to drop aborted requests


@dataclass
class Outcome:
    kind: str  # good | cancel | bad
    status: int | None = None
    ok: bool = False
    problem: str | None = None
    ttft: float | None = None
    accepted: float | None = None  # seconds to the response's headers (the engine took the request)
    start: float = 0.0  # when it was sent (perf_counter)
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    ids: set[str] = field(default_factory=set)
    end: float = 0.0


BAD_KINDS = ("temperature", "top_p", "max_tokens", "prompt_type", "json", "model", "too_long", "api_key")


def _bad_request(kind: str, body: dict, ctx: int) -> tuple[dict | bytes, dict]:
    headers = {}
    if kind == "temperature":
        body["temperature"] = -1
    elif kind == "top_p":
        body["top_p"] = 1.5
    elif kind == "max_tokens":
        body["max_tokens"] = 0
    elif kind == "prompt_type":
        body["prompt"] = {"not": "a prompt"}
    elif kind == "json":
        return b'{"model": "x", "prompt": [1, 2', headers
    elif kind == "model":
        body["model"] = "no-such-model"
    elif kind == "too_long":
        body["prompt"] = [1] * ctx
    elif kind == "api_key":
        headers["authorization"] = "Bearer wrong-key"
    return body, headers


class LoadTest:
    def __init__(self, cfg: LoadConfig):
        self.cfg = cfg
        self.headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}

    async def _get(self, client, path: str) -> str:
        async with client.get(self.cfg.url.rstrip("/") + path, headers=self.headers) as r:
            r.raise_for_status()
            return await r.text()

    async def metrics(self, client) -> dict:
        text = await self._get(client, "/metrics")
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
                out[key] = s.value
        return out

    def plan(self, model: str, ctx: int) -> list[tuple[str, dict, dict | bytes, dict]]:
        """(kind, request facts, body, extra headers) per request, from the seed."""
        c, rng = self.cfg, random.Random(self.cfg.seed)
        bad_kinds = [k for k in BAD_KINDS if k != "api_key" or c.api_key]
        out = []
        for i in range(c.requests):
            n_prompt = rng.randint(*c.prompt_len)
            body = {"model": model, "prompt": [rng.randrange(1, c.vocab) for _ in range(n_prompt)],
                    "max_tokens": rng.randint(*c.max_tokens), "temperature": 0.8, "seed": i,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            u = rng.random()
            kind = "bad" if u < c.bad_frac else "cancel" if u < c.bad_frac + c.cancel_frac else "good"
            facts = {"max_tokens": body["max_tokens"], "cancel_after": rng.randint(1, 3)}
            headers = {}
            if kind == "bad":
                facts["bad"] = bad_kinds[i % len(bad_kinds)]
                body, headers = _bad_request(facts["bad"], body, ctx)
            out.append((kind, facts, body, headers))
        return out

    async def one(self, client, kind: str, facts: dict, body, headers: dict) -> Outcome:
        o = Outcome(kind)
        url = self.cfg.url.rstrip("/") + "/v1/completions"
        kw = {"data": body, "headers": {**self.headers, **headers, "content-type": "application/json"}} \
            if isinstance(body, bytes) else {"json": body, "headers": {**self.headers, **headers}}
        t0 = o.start = time.perf_counter()
        try:
            async with client.post(url, **kw) as r:
                o.status, o.accepted = r.status, time.perf_counter() - t0
                if kind == "bad" or r.status != 200:
                    err = json.loads(await r.read()).get("error", {})
                    o.ok = kind == "bad" and 400 <= r.status < 500 and bool(err.get("message"))
                    o.problem = None if o.ok else f"status {r.status}: {err}"
                    return o
                await self._read_stream(r, o, facts, t0)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            o.problem = f"{type(e).__name__}: {e}"
        finally:
            o.end = time.perf_counter()
        return o

    async def _read_stream(self, r, o: Outcome, facts: dict, t0: float) -> None:
        chunks, finishes, usage, done, last = 0, [], [], 0, None
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                o.problem = f"error event: {msg['error']}"
                return
            o.ids.add(msg["id"])
            if msg.get("usage"):
                usage.append(msg["usage"])
            for ch in msg["choices"]:
                now = time.perf_counter()
                if last is None:
                    o.ttft = now - t0
                else:
                    o.itl.append(now - last)
                last = now
                chunks += 1
                if ch["finish_reason"] is not None:
                    finishes.append(ch["finish_reason"])
            if o.kind == "cancel" and chunks >= facts["cancel_after"] and not finishes:
                o.ok = True
                r.close()  # the connection closes mid-stream (not back to the pool)
                return
        o.tokens = usage[0]["completion_tokens"] if len(usage) == 1 else 0
        if o.tokens > 1:
            o.tpot = (last - t0 - o.ttft) / (o.tokens - 1)
        want = facts["max_tokens"]
        if done != 1 or len(finishes) != 1 or len(usage) != 1 or len(o.ids) != 1:
            o.problem = f"[DONE] x{done}, {len(finishes)} finish reasons, {len(usage)} usages, ids {o.ids}"
        elif not (o.tokens == want or finishes[0] == "stop"):
            o.problem = f"{o.tokens} tokens, finish {finishes[0]!r}; max_tokens was {want}"
        o.ok = o.problem is None

    async def run(self) -> dict:
        c = self.cfg
        # aiohttp: its HTTP parser is C; httpx's pure-Python one took ~1.7 ms a request of this
        # process, so 256 streams at once reached the server over ~0.45 s (H200, llama-1b)
        conn = aiohttp.TCPConnector(limit=c.concurrency)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600.0)) as client:
            card = json.loads(await self._get(client, "/v1/models"))["data"][0]
            plan = self.plan(card["id"], card.get("max_model_len", 4096))
            before = await self.metrics(client)
            sem, rng = asyncio.Semaphore(c.concurrency), random.Random(c.seed + 1)

            async def gated(item):
                async with sem:
                    return await self.one(client, *item)

            tasks, t0 = [], time.perf_counter()
            for item in plan:
                tasks.append(asyncio.create_task(gated(item)))
                if c.rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(c.rate))
            cpu0 = time.process_time()
            outs = await asyncio.gather(*tasks)
            wall = max(o.end for o in outs) - t0
            cpu = time.process_time() - cpu0
            after = await self._settle(client)
        return self.report(plan, outs, before, after, wall, cpu)

    async def _settle(self, client) -> dict:
        """/metrics once the engine holds nothing (or settle_s passed)."""
        deadline = time.perf_counter() + self.cfg.settle_s
        while True:
            m = await self.metrics(client)
            idle = all(m.get(f"llmaccel_{k}", 0) == 0 for k in ("requests_running", "requests_waiting",
                                                                  "kv_blocks_used"))
            if idle or time.perf_counter() > deadline:
                return m
            await asyncio.sleep(0.1)

    def report(self, plan, outs: list[Outcome], before: dict, after: dict, wall: float, cpu: float) -> dict:
        def delta(key):
            return after.get(key, 0) - before.get(key, 0)

        def pct(xs):
            return {f"p{q}": round(float(np.percentile(xs, q)), 5) for q in (50, 90, 99)} if xs else None

        good = [o for o in outs if o.kind == "good"]
        n = {k: sum(o.kind == k for o in outs) for k in ("good", "cancel", "bad")}
        ids = [i for o in outs for i in o.ids]
        statuses = {}
        for o in outs:
            statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
        finished = sum(delta(f"llmaccel_sequences_finished_total|reason={r}")
                       for r in ("stop", "length", "abort"))
        server_4xx = sum(v for k, v in after.items() if k.startswith("llmaccel_requests_total|status=4")) - \
            sum(v for k, v in before.items() if k.startswith("llmaccel_requests_total|status=4"))
        tokens = sum(o.tokens for o in good)
        meets = [o for o in good if o.ok and o.ttft is not None and o.ttft <= self.cfg.slo_ttft
                 and (o.tpot is None or o.tpot <= self.cfg.slo_tpot)]
        checks = {
            "good requests complete, each with its max_tokens": all(o.ok for o in good),
            "cancelled clients left mid-stream": all(o.ok for o in outs if o.kind == "cancel"),
            "bad requests get 4xx with an error body": all(o.ok for o in outs if o.kind == "bad"),
            "no response id repeated": len(ids) == len(set(ids)),
            "server counted every request once": delta("llmaccel_requests_total|status=200")
            == n["good"] + n["cancel"] and server_4xx == n["bad"],
            "every sequence finished exactly once": finished == n["good"] + n["cancel"],
            "engine idle afterwards (running, waiting, KV blocks 0)": all(
                after.get(f"llmaccel_{k}", -1) == 0 for k in ("requests_running", "requests_waiting",
                                                               "kv_blocks_used")),
        }
        return {
            "config": {**asdict(self.cfg), "rate": str(self.cfg.rate)}, "requests": n,
            "statuses": statuses, "wall_s": round(wall, 3), "output_tokens": tokens,
            "output_tok_s": round(tokens / wall, 1), "requests_s": round(len(good) / wall, 2),
            # near wall_s: the client, not the server, may have set the pace
            "client_cpu_s": round(cpu, 3),
            "goodput_requests_s": round(len(meets) / wall, 2),
            "accepted_s": pct([o.accepted for o in good if o.accepted is not None]),
            # the first request sent to the last one's headers: how long admitting the load took
            "accept_span_s": round(max((o.start + o.accepted for o in good if o.accepted is not None),
                                       default=0.0) - min(o.start for o in outs), 3),
            "ttft_s": pct([o.ttft for o in good if o.ttft is not None]),
            "tpot_s": pct([o.tpot for o in good if o.tpot is not None]),
            "itl_s": pct([x for o in good for x in o.itl]),
            "kv_blocks_used_after": after.get("llmaccel_kv_blocks_used"),
            # engine steps and seconds in them during the run: busy_s well below wall_s means
            # the engine waited for requests (the HTTP side), not the other way round; graphs
            # captured during a measured run are steps that paid for a capture
            "engine": {"steps": delta("llmaccel_engine_steps_total"),
                       "busy_s": round(delta("llmaccel_engine_busy_seconds_total"), 3),
                       "graphs_captured": delta("llmaccel_cuda_graphs_captured_total"),
                       "graph_capture_s": round(delta("llmaccel_cuda_graph_capture_seconds_total"), 3),
                       **{k: delta(f"llmaccel_engine_{k}_total") for k in STEP_COUNTERS}},
            "problems": [f"{o.kind}: {o.problem}" for o in outs if not o.ok][:10],
            "checks": checks, "ok": all(checks.values()),
        }


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


@contextlib.contextmanager
def serve_subprocess(*args: str, timeout: float = 600.0, stderr=None):
    """`llmc serve ARGS --port 0` with this interpreter and this checkout first on the path;
    yields (base URL, process) once /health answers; SIGTERM (then SIGKILL) at the end.
    stderr: where the server's stderr goes (Popen's argument; default: this process's)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "llmaccel.cli", "serve", *args, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        line = proc.stdout.readline()  # "llmc serve: NAME on http://HOST:PORT/v1"
        if " on http://" not in line:
            raise RuntimeError(f"the server did not start (status {proc.wait(timeout)})")
        url = line.split(" on ")[1].strip().removesuffix("/v1")
        wait_healthy(url, timeout, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def render(res: dict) -> str:
    lines = [f"{sum(res['requests'].values())} requests {res['requests']} in {res['wall_s']} s: "
             f"{res['output_tok_s']} output tok/s, {res['requests_s']} req/s, goodput "
             f"{res['goodput_requests_s']} req/s; statuses {res['statuses']}"]
    lines.append(f"  admitted in {res['accept_span_s']} s (first request sent to last headers); "
                 f"to headers {res['accepted_s']}")
    for k in ("ttft_s", "tpot_s", "itl_s"):
        lines.append(f"  {k[:-2].upper():5} {res[k]}")
    lines += [f"  [{'ok' if v else 'FAIL'}] {k}" for k, v in res["checks"].items()]
    lines += [f"  problem: {p}" for p in res["problems"]]
    return "\n".join(lines)


def _range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    return int(lo), int(hi or lo)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmaccel.serve.loadtest", description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    where.add_argument("--serve", metavar="'SRC [OPTIONS]'",
                       help="start `llmc serve SRC OPTIONS` on a free port for the run, e.g. 'preset:tiny-llama'")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--rate", type=float, default=float("inf"), help="mean arrivals per second (Poisson); inf: all at once")
    ap.add_argument("--cancel-frac", type=float, default=0.1)
    ap.add_argument("--bad-frac", type=float, default=0.05)
    ap.add_argument("--prompt-len", type=_range, default=(16, 64), metavar="MIN:MAX")
    ap.add_argument("--max-tokens", type=_range, default=(16, 64), metavar="MIN:MAX")
    ap.add_argument("--vocab", type=int, default=256, help="prompt token ids drawn from 1..VOCAB-1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-tpot", type=float, default=0.2)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = ap.parse_args(argv)
    if a.requests < 1 or a.concurrency < 1 or a.rate <= 0 or not 0 <= a.cancel_frac + a.bad_frac <= 1:
        ap.error("--requests, --concurrency and --rate must be positive, the fractions sum to at most 1")
    args = {k: v for k, v in vars(a).items() if k not in ("json", "serve")}
    try:
        with (serve_subprocess(*shlex.split(a.serve)) if a.serve else contextlib.nullcontext((a.url, None))) as (url, _):
            res = asyncio.run(LoadTest(LoadConfig(**{**args, "url": url})).run())
    except (aiohttp.ClientError, httpx.HTTPError, RuntimeError, TimeoutError) as e:
        print(f"loadtest: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(render(res))
    if a.json:
        print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
