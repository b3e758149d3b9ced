"""The serving app's own time per request: the admission path without HTTP or an engine.

    python scripts/serve_app_cost.py [--requests 256] [--reps 7]

Calls the ASGI app of `llmc serve` directly (no socket, no uvicorn) with N streamed
/v1/completions requests of 128-1024 random token ids at once, over an engine stub that accepts
each job and finishes every choice with one token in the same turn; prints the best of --reps
wall times over N, the event loop's time per request for routing, validation, submission and
one streamed delta. A burst of N requests reaches the engine no faster than N times this.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmaccel.serve.app import create_app  # noqa: E402
from llmaccel.serve.loop import ACCEPTED, Delta, Frontend  # noqa: E402


class StubEngine(Frontend):
    """Accepts every job and ends each choice with one token, at once."""

    facts = dict(max_position=4096, vocab_size=32000, tokenizer_dir=None)
    alive = True

    def start(self) -> None:
        pass

    def shutdown(self, timeout: float = 10.0) -> None:
        pass

    def _send(self, cmd: tuple) -> None:
        kind, job = cmd
        if kind == "add":
            self.route(job, ACCEPTED)
            for i in range(len(job.prompts)):
                self.route(job, Delta(i, [5], "", [], "length"))
            self.flush()


def scope(body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
            "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}


async def call(app, body: bytes) -> list[dict]:
    """One request through the app; its messages as sent."""
    read = False

    async def receive():
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves

    out = []

    async def send(msg):
        out.append(msg)

    await app(scope(body), receive, send)
    return out


async def measure(n: int, reps: int) -> float:
    app = create_app(StubEngine(), name="m")
    rng = random.Random(0)
    bodies = [json.dumps({"model": "m", "prompt": [rng.randrange(1, 32000) for _ in range(rng.randint(128, 1024))],
                          "max_tokens": 300, "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}).encode() for i in range(n)]
    async with app.router.lifespan_context(app):
        for b in bodies[:20]:  # warm-up
            await call(app, b)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            outs = await asyncio.gather(*(call(app, b) for b in bodies))
            best = min(best, time.perf_counter() - t)
        bad = [o for o in outs if o[0].get("status") != 200 or b"[DONE]" not in o[-2]["body"]]
        if bad:
            raise SystemExit(f"a request did not complete: {bad[0]}")
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    best = run(measure(a.requests, a.reps))
    print(f"{a.requests} streamed requests through the app: {best * 1e3:.1f} ms, "
          f"{best / a.requests * 1e6:.0f} us each (best of {a.reps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
