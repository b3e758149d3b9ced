"""EngineProcess: the engine loop in a process of its own, what `llmc serve` runs.

On a thread, the engine shares the GIL with the event loop that writes 256 streams: each time
a CUDA call gives the GIL back, the engine waits for the HTTP side's Python before it can
launch the next step, and the GPU idles (measured on an H200, llama-1b, 256 streams: the server
reached 0.52x the offline throughput). In a process of its own it never waits for the HTTP side.

The child builds the `LLM` and runs EngineLoop; commands go to it through one pipe (a sender
thread here, so a handler never blocks on a full pipe) and each engine turn comes back through
another as one message: the turn's events, observations and figures, read by a thread here that
routes them to the jobs' event loops. Jobs cross the boundary as (id, prompts, params, t0);
the commands of one wake-up of the sender go as one message (a burst of 256 requests: a few
messages, not 256); a Delta crosses as a plain tuple (pickling 256 dataclasses took ~0.5 ms a
turn, with the engine thread waiting for the GIL; tuples, a fifth of that).
"""
from __future__ import annotations

import gc
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
from collections import deque

from llmaccel.errors import LlmaccelError
from llmaccel.serve.loop import Delta, EngineLoop, Frontend, ServeError, model_facts

log = logging.getLogger("llmaccel.serve")
SWITCH_INTERVAL_S = 0.001


def _ends(item) -> bool:
    """Whether this event (as sent: a Delta is a tuple) ends its job's choice (all of them, for
    an error)."""
    return isinstance(item, ServeError) or (isinstance(item, tuple) and item[-1] is not None)


def _wire(item):
    """An event as it crosses the pipe: a Delta as a tuple of its fields."""
    if isinstance(item, Delta):
        return item.index, item.token_ids, item.text, item.logprobs, item.finish_reason
    return item


class _RemoteJob:
    """A job as the child sees it."""

    def __init__(self, jid: int, prompts, params, t0: float):
        self.id, self.prompts, self.params, self.t0 = jid, prompts, params, t0
        self.left = len(prompts)  # choices that have not sent their last event


class _PipeInbox:
    """The child's inbox: the command pipe (lists of commands), with abort ids turned back into
    the jobs."""

    def __init__(self, conn):
        self.conn, self.jobs = conn, {}
        self._buf: deque = deque()

    def _recv(self):
        if not self._buf:
            try:
                self._buf.extend(self.conn.recv())
            except EOFError:  # the server process is gone: nothing is listening any more
                return "stop", None
        kind, arg = self._buf.popleft()
        if kind == "add":
            arg = self.jobs.setdefault(arg[0], _RemoteJob(*arg))
        elif kind == "abort":
            arg = self.jobs.pop(arg, None)
            if arg is None:
                return "noop", None
        return kind, arg

    def get(self, timeout: float | None = None):
        if not self._buf and not self.conn.poll(timeout):
            raise queue.Empty
        return self._recv()

    def get_nowait(self):
        return self.get(0)


class _PipeOut:
    """The child's side of route / flush / record / publish: a message per flush, pickled and
    sent by a thread of its own while the engine thread goes on to its next step (the pickling
    of a turn's 256 deltas would otherwise keep the GPU waiting)."""

    def __init__(self, conn, inbox: _PipeInbox):
        self.conn, self.inbox = conn, inbox
        self.events, self.observed, self.figures = [], [], None
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, name="llmaccel-engine-events", daemon=True)
        self._sender.start()

    def _send_all(self) -> None:
        try:
            while (msg := self._q.get()) is not None:
                self.conn.send(msg)
        except Exception:  # noqa: BLE001 - events can no longer reach the server
            log.exception("engine process: sending events failed")
            # exit, so that the server sees the pipe close and fails what is in flight
            os._exit(1)

    def route(self, job: _RemoteJob, item) -> None:
        self.events.append((job.id, _wire(item)))

    def record(self, kind: str, value) -> None:
        self.observed.append((kind, value))

    def publish(self, figures: dict) -> None:
        self.figures = figures
        self.flush()

    def flush(self) -> None:
        if self.events or self.observed or self.figures is not None:
            self._q.put(("turn", self.events, self.observed, self.figures))
            for jid, item in self.events:  # the child forgets a job once every choice ended
                job = self.inbox.jobs.get(jid)
                if job is not None and _ends(item):
                    job.left = 0 if isinstance(item, ServeError) else job.left - 1
                    if job.left <= 0:
                        del self.inbox.jobs[jid]
            self.events, self.observed, self.figures = [], [], None

    def close(self, last: tuple) -> None:
        """Send what is queued, then `last`."""
        self._q.put(last)
        self._q.put(None)
        self._sender.join()


def unfreeze_for_exit() -> None:
    """Give what gc.freeze() set aside back to the collector before the interpreter exits: the
    exit's collection skips frozen objects, so cycles holding triton's nanobind objects would
    outlive its module, and nanobind would print some 60 lines of "leaked" instances, types
    and functions on stderr at every shutdown."""
    gc.unfreeze()


def _child(cmd_conn, out_conn, llm_kwargs: dict, warmup: int) -> None:
    # the server process decides when to stop (a signal to the whole process group, as a
    # terminal's Ctrl-C or a service manager's stop sends, must not skip its drain)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from llmaccel.runtime.engine import LLM

        llm = LLM(**llm_kwargs)
        # before the server answers: no request within that context waits for a compile
        warm = llm.warmup(warmup, progress=True) if warmup else None
    except BaseException as e:  # noqa: BLE001 - reported to the server process, which exits 2
        out_conn.send(("failed", f"{type(e).__name__}: {e}" if not isinstance(e, LlmaccelError) else str(e)))
        return
    out_conn.send(("ready", {**model_facts(llm), "warmup": warm}))
    # the engine thread and the sender share this process's GIL: a thread that wants it back
    # (the sender with a turn's events, the engine back from a CUDA sync) waits at most 1 ms
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # the model, torch and the engine live as long as this process: out of the collector's way,
    # so that a full collection (the turns' events make them frequent) does not stop the engine
    # thread to scan them
    gc.collect()
    gc.freeze()
    inbox = _PipeInbox(cmd_conn)
    out = _PipeOut(out_conn, inbox)
    result = []
    # on a thread, as LLM runs in a server thread or a user's: on a busy CPU, torch's intra-op
    # pool makes small ops of the main thread several times slower
    t = threading.Thread(target=lambda: result.append(EngineLoop(llm, inbox, out).run()))
    t.start()
    t.join()
    err = result[0] if result else RuntimeError("the engine thread ended without a result")
    llm.close()  # a tensor-parallel engine's workers
    out.close(("died", repr(err)) if err is not None else ("stopped", None))
    unfreeze_for_exit()


class EngineProcess(Frontend):
    """Starts the engine process (blocking until its LLM is built: LlmaccelError if it can't
    be) with LLM(**llm_kwargs); warmup > 0: then LLM.warmup(warmup) (facts["warmup"] says what
    it took)."""

    def __init__(self, *, warmup: int = 0, **llm_kwargs):
        super().__init__()
        ctx = mp.get_context("spawn")  # CUDA cannot live in a forked child
        cmd_r, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_w = ctx.Pipe(duplex=False)
        # a daemon may not start processes: a tensor-parallel engine's does (its workers),
        # and shutdown() stops it as it stops a daemon
        self._proc = ctx.Process(target=_child, args=(cmd_r, out_w, llm_kwargs, warmup), name="llmaccel-engine",
                                 daemon=llm_kwargs.get("tensor_parallel_size", 1) == 1)
        self._proc.start()
        cmd_r.close()
        out_w.close()
        try:
            kind, arg = self._out.recv()
        except EOFError:
            kind, arg = "failed", f"the engine process exited with code {self._proc.join(5) or self._proc.exitcode}"
        if kind != "ready":
            self._proc.join(5)
            raise LlmaccelError(arg)
        self.facts = arg
        self._ids = itertools.count()
        self._jobs: dict[int, list] = {}    # id in the engine process -> [job, choices not ended]
        self._job_ids: dict[int, int] = {}  # id(job) -> its id in the engine process
        self._outq: queue.SimpleQueue = queue.SimpleQueue()
        self._running = False
        self._reader = threading.Thread(target=self._read, name="llmaccel-engine-events", daemon=True)
        self._sender = threading.Thread(target=self._write, name="llmaccel-engine-commands", daemon=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        # not Process.is_alive: every submission asks, and its waitpid took ~5% of the server's
        # time in a burst; the reader sees the pipe close as soon as the process ends
        return self._running and self.error is None

    def start(self) -> None:
        self._running = True
        self._reader.start()
        self._sender.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left (its handlers get 503) and stop the process."""
        self.close()
        self._send(("stop", None))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._outq.put(None)
        self._reader.join(timeout)
        self._running = False

    # ------------------------------------------------------------ commands
    def _send(self, cmd: tuple) -> None:
        kind, arg = cmd
        if kind == "add":
            jid = next(self._ids)
            with self._lock:
                running = self._running
                if running:
                    self._jobs[jid], self._job_ids[id(arg)] = [arg, len(arg.prompts)], jid
                else:  # the reader has failed what was in flight: this one would wait forever
                    arg.taken = True
                    self._in_flight_adds -= len(arg.prompts)
            if not running:
                arg.events.put_nowait(self._gone())  # on the job's event loop: submit runs there
                return
            arg = (jid, arg.prompts, arg.params, arg.t0)
        elif kind == "abort":
            with self._lock:
                jid = self._job_ids.pop(id(arg), None)
                self._jobs.pop(jid, None)
                if not arg.taken:  # its answer will not be routed: it is no longer in flight
                    arg.taken = True
                    self._in_flight_adds -= len(arg.prompts)
            if jid is None:
                return
            arg = jid
        self._outq.put((kind, arg))

    def _write(self) -> None:
        """Send what is queued as one message (a burst's requests reach the engine together)."""
        while (cmd := self._outq.get()) is not None:
            cmds = [cmd]
            try:
                while (cmd := self._outq.get_nowait()) is not None:
                    cmds.append(cmd)
            except queue.Empty:
                pass
            try:
                self._cmd.send(cmds)
            except (BrokenPipeError, OSError):  # the engine process is gone; the reader says why
                return
            if cmd is None:
                return

    # ------------------------------------------------------------ events
    def _read(self) -> None:
        try:
            while True:
                kind, *rest = self._out.recv()
                if kind != "turn":
                    if kind == "died":
                        self.error = RuntimeError(f"engine loop died: {rest[0]}")
                    return
                events, observed, figures = rest
                self._turn(events, observed, figures)
        except (EOFError, OSError):
            code = self._proc.join(5) or self._proc.exitcode
            self.error = RuntimeError(f"the engine process exited (code {code})")
        except Exception as e:  # noqa: BLE001 - a bug here must not leave /health saying ok
            log.exception("routing the engine's events failed")
            self.error = RuntimeError(f"routing the engine's events failed: {type(e).__name__}: {e}")
        finally:
            self._end()

    def _turn(self, events, observed, figures) -> None:
        routed = []
        with self._lock:
            for jid, item in events:
                entry = self._jobs.get(jid)
                if entry is None:  # aborted meanwhile
                    continue
                if _ends(item):
                    entry[1] = 0 if isinstance(item, ServeError) else entry[1] - 1
                    if entry[1] <= 0:  # its last event: forget it
                        del self._jobs[jid]
                        self._job_ids.pop(id(entry[0]), None)
                routed.append((entry[0], Delta(*item) if isinstance(item, tuple) else item))
        for job, item in routed:
            self.route(job, item)
        for kind, value in observed:
            self.record(kind, value)
        if figures is not None:
            self._core = figures
        self.flush()

    def _gone(self) -> ServeError:
        """What a job the engine can no longer answer ends with."""
        return (ServeError(503, "the server is shutting down") if self.error is None
                else ServeError(500, str(self.error)))

    def _end(self) -> None:
        """The engine is gone: every job still waiting ends with 500 (or 503 on shutdown)."""
        with self._lock:
            self._running = False
            jobs, self._jobs, self._job_ids = [e[0] for e in self._jobs.values()], {}, {}
        err = self._gone()
        for job in jobs:
            self.route(job, err)
        self.flush()
        self._outq.put(None)
