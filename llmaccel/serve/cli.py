"""Argparse wiring of `llmc serve` (llmaccel/cli.py calls add_parser); the HTTP stack is
imported only when the command runs, so the rest of llmc works without the serve extra."""
from __future__ import annotations

import gc
import os
import signal
import socket
import sys

from llmaccel.errors import LlmaccelError, require_extra

BACKLOG = 2048
UVICORN_GRACE_S = 5.0


def _check(a) -> None:
    for name, lo in (("port", 0), ("max_waiting", 0), ("max_num_seqs", 1), ("shutdown_timeout", 0),
                     ("warmup_context", 0), ("tp", 1)):
        if getattr(a, name) < lo:
            raise LlmaccelError(f"--{name.replace('_', '-')} must be at least {lo}, got {getattr(a, name)}")
    if a.port > 65535:
        raise LlmaccelError(f"--port must be at most 65535, got {a.port}")
    from llmaccel.compiler.sources import check_draft

    check_draft(a.speculative)


def _bind(host: str, port: int) -> socket.socket:
    try:  # uvicorn's backlog: a burst of connections beyond it would be reset
        return socket.create_server((host, port), backlog=BACKLOG)
    except OSError as e:
        raise LlmaccelError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run_server(app, sock: socket.socket, *, shutdown_timeout: float, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM. On SIGTERM admission stops, requests in flight get up to
    shutdown_timeout seconds to finish (the rest are aborted), and this returns normally."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.server.loop.close(grace=shutdown_timeout)
            super().handle_exit(sig, frame)

    # The engine loop ends what is left after shutdown_timeout with a 503 each; uvicorn's own
    # limit, later, only backs it up (it cancels handlers, which then answer a bare 500).
    config = uvicorn.Config(app, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout + UVICORN_GRACE_S)
    # uvicorn re-raises the signal it stopped on with the handler it found: a handler that does
    # nothing makes SIGTERM end the process with status 0 once the server is down
    signal.signal(signal.SIGTERM, lambda *_: None)
    # A server started with SIGINT ignored (a script's background job, or a parent that ignores
    # it) still stops on SIGINT through uvicorn, but uvicorn's re-raise then does nothing and the
    # process exits 0; with Python's own handler back, that stop ends as a Ctrl-C does (130).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # The thread that routes the engine's events shares the GIL with the event loop. A thread
    # coming back from a call that released it (a pipe read, a socket write) waits until the
    # holder yields, by default up to 5 ms; every stream's tokens would wait that long.
    from llmaccel.serve.process import SWITCH_INTERVAL_S, unfreeze_for_exit

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # what is loaded by now lives as long as the server: out of the collector's way, so that a
    # full collection in a burst scans the requests' objects only
    gc.collect()
    gc.freeze()
    try:
        _Server(config).run(sockets=[sock])
    finally:
        unfreeze_for_exit()


def cmd_serve(a) -> None:
    for module in ("fastapi", "prometheus_client", "uvicorn"):
        require_extra(module, "serve", "llmc serve")
    _check(a)
    from llmaccel.serve.app import create_app
    from llmaccel.serve.process import EngineProcess

    opts = {} if a.max_num_batched_tokens is None else {"max_num_batched_tokens": a.max_num_batched_tokens}
    sock = _bind(a.host, a.port)  # a port in use fails before the model loads
    engine = EngineProcess(source=a.src, max_num_seqs=a.max_num_seqs, kv_cache_tokens=a.kv_cache_tokens,
                           speculative=a.speculative, enable_prefix_caching=not a.no_prefix_caching,
                           device=a.device, dtype=a.dtype, warmup=a.warmup_context,
                           tensor_parallel_size=a.tp, **opts)
    warm = engine.facts.get("warmup")
    if warm and warm["shapes"]:
        print(f"llmc serve: {warm['shapes']} step shapes warmed up (compiled, captured) in {warm['seconds']:.1f} s",
              file=sys.stderr, flush=True)
    name = a.served_model_name or a.src
    app = create_app(engine, name=name, api_key=a.api_key or os.environ.get("LLMACCEL_API_KEY") or None,
                     max_waiting=a.max_waiting)
    host, port = sock.getsockname()[:2]
    print(f"llmc serve: {name} on http://{host}:{port}/v1", flush=True)
    run_server(app, sock, shutdown_timeout=a.shutdown_timeout, log_level=a.log_level)
    print("llmc serve: stopped", file=sys.stderr)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, "
                                            "streaming, /metrics) over LLM")
    p.add_argument("src", help="smollm2-135m | preset:NAME | HF dir | .gguf | artifact dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: SRC)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                                                   "(default: $LLMACCEL_API_KEY, else none)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences the engine runs at once")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel ranks (one GPU each)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (default: LLM's)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache size (default: memory budget)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--warmup-context", type=int, default=2048, metavar="TOKENS",
                   help="before answering, capture the CUDA graphs of every decode batch for contexts up "
                        "to TOKENS (default 2048; longer ones capture on first use, the steps meeting "
                        "them wait; 0: none)")
    p.add_argument("--speculative", default=None, metavar="self|ngram|SRC")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="queued sequences past which new requests get 429")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight get to finish after SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.set_defaults(fn=cmd_serve)
