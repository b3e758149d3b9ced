"""The engine loop: the one owner of an `LLM`. HTTP handlers reach it only through queues.

`LLM` is not thread-safe, so one loop (EngineLoop) adds, steps and aborts. Handlers submit a
`Job` (one HTTP request: one sequence per prompt and choice) through a frontend and read its
events from an asyncio queue the frontend feeds with `call_soon_threadsafe`, one wake-up per
engine turn. Two frontends, one core: EngineThread runs the core on a thread of this process
(tests reach into its LLM); EngineProcess (serve/process.py, what `llmc serve` runs) runs it in
a process of its own, so the engine never waits for the HTTP side's Python (the GIL) between
steps. An exception inside a step fails the jobs whose sequences were in it (HTTP 500) and the
loop keeps serving the others.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from llmaccel.errors import LlmaccelError
from llmaccel.sampling import SamplingParams
from llmaccel.serve.metrics import STEP_COUNTERS
from llmaccel.runtime.sequence import Sequence

log = logging.getLogger("llmaccel.serve")


class ServeError(Exception):
    """A request that ends with an HTTP error: status, message and OpenAI error type."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def __reduce__(self):  # crosses the process boundary with all its fields
        return ServeError, (self.status, self.message, self.param, self.code)


@dataclass
class Delta:
    """New output of one choice since its last Delta; finish_reason set on the last one."""
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict]
    finish_reason: str | None = None


ACCEPTED = "accepted"  # the first event of a job whose sequences all entered the engine


class Events:
    """A job's events in order: put on the job's event loop (a batch per engine turn), taken
    by its handler. A deque and one future while the handler waits: an asyncio.Queue read
    with a timeout costs a task and a timer per event, and 256 streams get 256 events a turn."""

    def __init__(self):
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        self.wake()

    def wake(self) -> None:
        """End a wait() now (an item came, or the client went away)."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def wait(self) -> None:
        """Until an item is there or wake() is called."""
        if self._items:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def get(self):
        while not self._items:
            await self.wait()
        return self._items.popleft()


class Job:
    """One HTTP request: a prompt and sampling params per choice, and the events it receives."""

    def __init__(self, prompts: list[list[int]], params: list[SamplingParams]):
        self.prompts, self.params = prompts, params
        self.events = Events()  # ACCEPTED, Deltas, or a ServeError
        self.aio = asyncio.get_running_loop()
        # time.perf_counter is the system's monotonic clock: an engine process reads it too
        self.t0 = time.perf_counter()
        self.gone = False  # set when its client closed the connection
        self.done = False  # set by the handler: every choice finished, an error, or it aborted
        self.taken = False  # the engine answered its submission (ACCEPTED or an error)


def _deliver(items: list[tuple[Job, object]]) -> None:
    for job, item in items:
        job.events.put_nowait(item)


class Frontend:
    """The handlers' side of an engine loop: admission control, commands in, events routed to
    each job's event loop. Subclasses move commands and events (a thread or a process)."""

    def __init__(self, *, max_waiting: int = 1024):
        self.max_waiting = max_waiting
        self.metrics = None  # a ServeMetrics the events are recorded into, set by the server
        self.error: BaseException | None = None  # why the engine loop died, if it did
        self._lock = threading.Lock()
        self._in_flight_adds = 0   # choices submitted, not yet answered by the engine
        self._closed = False
        self._core: dict = {}      # the core's latest figures, replaced (not mutated) per turn
        self._routed: dict[asyncio.AbstractEventLoop, list] = {}

    facts: dict  # max_position, vocab_size, tokenizer_dir of the model served

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _send(self, cmd: tuple) -> None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    @property
    def snapshot(self) -> dict:
        core = self._core
        with self._lock:
            waiting = core.get("engine_waiting", 0) + self._in_flight_adds
        return {**{k: v for k, v in core.items() if k != "engine_waiting"}, "waiting": waiting}

    def close(self, grace: float | None = None) -> None:
        """Stop admission: every later submit gets 503 (shutdown has begun). After `grace`
        seconds, requests still in flight end with 503 and their blocks are freed."""
        # no lock: this runs in a signal handler, perhaps while the interrupted code holds it
        self._closed = True
        self._send(("close", grace))

    def submit(self, job: Job) -> None:
        n = len(job.prompts)
        with self._lock:
            if self._closed or not self.alive:
                raise ServeError(503, "the server is shutting down" if self._closed
                                 else "the engine loop has stopped")
            queued = self._in_flight_adds + self._core.get("engine_waiting", 0)
            if queued + n > self.max_waiting:
                raise ServeError(429, f"too many requests waiting ({queued} sequences queued, "
                                      f"limit {self.max_waiting}); retry later")
            self._in_flight_adds += n
        self._send(("add", job))

    def abort(self, job: Job) -> None:
        self._send(("abort", job))

    # ------------------------------------------------------------ events, on the engine's side
    def route(self, job: Job, item) -> None:
        """Queue one event for its job (delivered at the next flush)."""
        if item == ACCEPTED or isinstance(item, ServeError):
            with self._lock:  # an abort before the answer also settles the count (process.py)
                if not job.taken:
                    job.taken = True
                    self._in_flight_adds -= len(job.prompts)
        self._routed.setdefault(job.aio, []).append((job, item))

    def flush(self) -> None:
        """Hand each event loop its events in one call: a wake-up per engine turn, not one per
        event (256 streams emit 256 events a step)."""
        items, self._routed = self._routed, {}
        for aio, batch in items.items():
            try:
                aio.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def record(self, kind: str, value) -> None:
        if self.metrics is not None:
            self.metrics.record(kind, value)


@dataclass
class _Choice:
    job: object
    index: int
    seq: Sequence
    sent_tokens: int = 0
    sent_text: int = 0
    sent_lps: int = 0
    first_t: float | None = None


class EngineLoop:
    """The loop that owns `llm`. Commands come from `inbox` (get(timeout) / get_nowait, raising
    queue.Empty): ("add", job), ("abort", job), ("close", grace), ("stop", None); a job has
    prompts, params and t0. Events go to `out` (route(job, item), flush(), record(kind, value),
    publish(figures))."""

    def __init__(self, llm, inbox, out):
        self.llm, self.inbox, self.out = llm, inbox, out
        self.has_text = llm.model.tokenizer_dir is not None
        self._choices: list[_Choice] = []
        self._deadline: float | None = None  # when shutdown fails what is still in flight
        self._busy = 0.0  # seconds inside llm.step(): against wall time, how busy the engine was

    def run(self) -> BaseException | None:
        """Serve until ("stop", None); the exception that killed the loop, if one did."""
        try:
            self._publish()
            while self._drain(block=not self._choices and not self.llm.has_unfinished()):
                if self._deadline is not None and time.monotonic() > self._deadline and self._choices:
                    self._fail([c.job for c in self._choices],
                               ServeError(503, "the server shut down before this request finished"))
                self.out.flush()  # acceptances and errors before a step that may be long
                if self.llm.has_unfinished():
                    self._step()
                self._emit()
                self.out.flush()
                self._publish()
        except BaseException as e:  # a bug in the loop itself: /health turns 503
            log.exception("engine loop died")
            self._fail([c.job for c in self._choices], ServeError(500, f"engine loop died: {e}"))
            self.out.flush()
            return e
        self._fail([c.job for c in self._choices], ServeError(503, "the server is shutting down"))
        self.out.flush()
        self._publish()
        return None

    def _drain(self, block: bool) -> bool:
        """Handle queued commands (waiting for one when idle); False on stop."""
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = item
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._fail([arg], None)
            elif kind == "close" and arg is not None:
                self._deadline = time.monotonic() + arg
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, job) -> None:
        choices = []
        try:
            for i, (ids, params) in enumerate(zip(job.prompts, job.params)):
                seq = self.llm.add_request(ids, params)
                choices.append(_Choice(job, i, seq))
                if seq.finish_reason == "error":
                    raise ServeError(400, seq.error)
        except (ServeError, LlmaccelError) as e:
            for c in choices:
                self.llm.abort(c.seq)
            self.out.route(job, e if isinstance(e, ServeError) else ServeError(400, str(e)))
            return
        self._choices += choices
        self.out.route(job, ACCEPTED)

    def _fail(self, jobs: list, err: ServeError | None) -> None:
        """Abort every sequence of these jobs (freeing their blocks); tell them err if any."""
        ids = {id(j) for j in jobs}
        keep = []
        for c in self._choices:
            if id(c.job) not in ids:
                keep.append(c)
            elif not c.seq.finished:
                try:
                    self.llm.abort(c.seq)
                except Exception:  # noqa: BLE001 - a sequence a failed step left half-updated
                    log.exception("abort after a failure")
                self.out.record("finished", "abort" if err is None else "error")
        self._choices = keep
        if err is not None:
            for j in {id(j): j for j in jobs}.values():
                self.out.route(j, err)

    def _step(self) -> None:
        t = time.perf_counter()
        try:
            self.llm.step()
        except Exception as e:  # noqa: BLE001 - a failed step must not take the server down
            log.exception("engine step failed")
            # the sequences holding KV blocks were in the step; when none does, every one
            # still unfinished, so that a step that keeps failing cannot spin
            live = [c for c in self._choices if not c.seq.finished]
            hit = [c for c in live if c.seq.block_table] or live
            self._fail([c.job for c in hit], ServeError(500, f"engine step failed: {type(e).__name__}: {e}"))
        finally:
            self._busy += time.perf_counter() - t

    def _emit(self) -> None:
        now = time.perf_counter()
        keep = []
        for c in self._choices:
            seq = c.seq
            if seq.n_output > c.sent_tokens or seq.finished:
                self.out.route(c.job, self._delta(c))
                if c.first_t is None and c.sent_tokens:
                    c.first_t = now
                    self.out.record("ttft", now - c.job.t0)
            if seq.finished:
                if c.sent_tokens > 1:
                    self.out.record("tpot", (now - c.first_t) / (c.sent_tokens - 1))
                self.out.record("finished", seq.finish_reason)
            else:
                keep.append(c)
        self._choices = keep

    def _delta(self, c: _Choice) -> Delta:
        seq = c.seq
        ids = seq.token_ids[seq.n_prompt + c.sent_tokens:]  # the new ones only (output_ids copies all)
        c.sent_tokens += len(ids)
        lps = seq.logprobs[c.sent_lps:] if seq.logprobs is not None else []
        c.sent_lps += len(lps)
        text = ""
        if self.has_text:
            full = self.llm.visible_text(seq)
            text = full[c.sent_text:]
            c.sent_text = max(c.sent_text, len(full))
        return Delta(c.index, ids, text, lps, seq.finish_reason if seq.finished else None)

    def _publish(self) -> None:
        m = self.llm.metrics()
        running = sum(1 for c in self._choices if c.seq.block_table)
        self.out.publish(dict(running=running, engine_waiting=len(self._choices) - running,
                              kv_blocks_used=m["kv_blocks_used"], kv_blocks_total=m["kv_blocks_total"],
                              preemptions=m["preemptions"], prompt_tokens=m["prompt_tokens"],
                              generated_tokens=m["generated_tokens"], steps=m["steps"],
                              busy_s=self._busy, graphs_captured=m["graphs_captured"],
                              graph_capture_s=m["graph_capture_s"],
                              **{k: m[k] for k in STEP_COUNTERS}))


def model_facts(llm) -> dict:
    """What the HTTP side needs to know of the model an engine serves."""
    return dict(max_position=llm.cfg.max_position, vocab_size=llm.cfg.vocab_size,
                tokenizer_dir=llm.model.tokenizer_dir)


class EngineThread(Frontend):
    """The core on a thread of this process, over `llm` (tests reach into it)."""

    def __init__(self, llm, *, max_waiting: int = 1024):
        super().__init__(max_waiting=max_waiting)
        self.llm = llm
        self.facts = model_facts(llm)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="llmaccel-engine", daemon=True)

    def _run(self) -> None:
        self.error = EngineLoop(self.llm, self._inbox, self).run()

    def publish(self, figures: dict) -> None:
        self._core = figures

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _send(self, cmd: tuple) -> None:
        self._inbox.put(cmd)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left (its handlers get 503) and stop the thread."""
        self.close()
        self._send(("stop", None))
        self._thread.join(timeout)
