"""Servers for the serve tests: `llmc serve` as a subprocess, or the app on a thread of this
process (to reach into the engine: fault injection, admission limits)."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]


def wait_healthy(url: str, timeout: float = 60.0, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


@contextlib.contextmanager
def serve_subprocess(*args: str, timeout: float = 60.0):
    """`llmc serve ARGS --port 0`; yields (base URL, process); SIGTERM at the end."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "llmaccel.cli", "serve", *args, "--port", "0",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()  # "llmc serve: NAME on http://HOST:PORT/v1"
        if " on http://" not in line:
            proc.wait(timeout)
            raise RuntimeError(f"server did not start: {line!r} {proc.stderr.read()}")
        url = line.split(" on ")[1].strip().removesuffix("/v1")
        wait_healthy(url, timeout, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def serve_thread(llm, **kw):
    """The app over `llm` served by uvicorn on a thread; yields (base URL, Server)."""
    import uvicorn

    from llmaccel.serve.app import create_app

    app = create_app(llm, name=kw.pop("name", "m"), **kw)
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        wait_healthy(url, 30)
        yield url, app.state.server
    finally:
        server.should_exit = True
        t.join(30)
