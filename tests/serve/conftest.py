"""Servers for the serve tests: `llmc serve` as a subprocess (loadtest.serve_subprocess), or the
app on a thread of this process (to reach into the engine: fault injection, admission limits)."""
import contextlib
import socket
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from llmaccel.serve.loadtest import wait_healthy  # noqa: E402


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


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """As in tests/runtime: one intra-op thread; tiny ops on a busy 2-core machine lose more to
    thread hand-offs than they gain."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
