"""The engine thread: the one owner of an `LLM`. HTTP handlers reach it only through queues.

`LLM` is not thread-safe, so a single thread adds, steps and aborts. Handlers submit a `Job`
(one HTTP request: one sequence per prompt and choice) into the inbox and read its events from
an asyncio queue the thread feeds with `call_soon_threadsafe`. An exception inside a step fails
the jobs whose sequences were in it (HTTP 500) and the loop keeps serving the others.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from llmaccel.errors import LlmaccelError
from llmaccel.sampling import SamplingParams
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


@dataclass
class Delta:
    """New output of one choice since its last Delta; finish_reason set on the last one."""
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict]
    finish_reason: str | None = None


ACCEPTED = "accepted"  # the first event of a job whose sequences all entered the engine


class Job:
    """One HTTP request: a prompt and sampling params per choice, and the events it receives."""

    def __init__(self, prompts: list[list[int]], params: list[SamplingParams]):
        self.prompts, self.params = prompts, params
        self.events: asyncio.Queue = asyncio.Queue()  # ACCEPTED, Deltas, or a ServeError
        self.aio = asyncio.get_running_loop()
        self.t0 = time.perf_counter()
        self.checked = time.monotonic()  # when the handler last asked whether its client is there
        self.done = False  # set by the handler when it saw every choice finish or an error


def _deliver(items: list[tuple[Job, object]]) -> None:
    for job, item in items:
        job.events.put_nowait(item)


class _Outbox:
    """Events gathered over one turn of the engine loop and handed to each event loop in one
    call: a wake-up per turn, not one per event (256 streams emit 256 events a step)."""

    def __init__(self):
        self.items: dict[asyncio.AbstractEventLoop, list] = {}

    def post(self, job: Job, item) -> None:
        self.items.setdefault(job.aio, []).append((job, item))

    def flush(self) -> None:
        items, self.items = self.items, {}
        for aio, batch in items.items():
            try:
                aio.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass


@dataclass
class _Choice:
    job: Job
    index: int
    seq: Sequence
    sent_tokens: int = 0
    sent_text: int = 0
    sent_lps: int = 0
    first_t: float | None = None


class EngineLoop:
    """Runs `llm` on its own thread. metrics: a ServeMetrics (or None) it reports into."""

    def __init__(self, llm, *, max_waiting: int = 1024, metrics=None):
        self.llm, self.max_waiting, self.metrics = llm, max_waiting, metrics
        self.has_text = llm.model.tokenizer_dir is not None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._choices: list[_Choice] = []
        self._out = _Outbox()
        self._lock = threading.Lock()
        self._in_flight_adds = 0   # choices submitted, not yet added to the engine
        self._engine_waiting = 0   # choices in the engine that hold no KV blocks yet
        self._closed = False
        self._deadline: float | None = None  # when shutdown fails what is still in flight
        self.error: BaseException | None = None  # why the thread died, if it did
        self.snapshot: dict = {}  # engine figures for /metrics, replaced (not mutated) per turn
        self._thread = threading.Thread(target=self._run, name="llmaccel-engine", daemon=True)

    # ------------------------------------------------------------ the handlers' side
    def start(self) -> None:
        self._publish()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def close(self, grace: float | None = None) -> None:
        """Stop admission: every later submit gets 503 (shutdown has begun). After `grace`
        seconds, requests still in flight end with 503 and their blocks are freed."""
        with self._lock:
            self._closed = True
            if grace is not None:
                self._deadline = time.monotonic() + grace

    def submit(self, job: Job) -> None:
        n = len(job.prompts)
        with self._lock:
            if self._closed or not self.alive:
                raise ServeError(503, "the server is shutting down" if self._closed
                                 else "the engine loop has stopped")
            queued = self._in_flight_adds + self._engine_waiting
            if queued + n > self.max_waiting:
                raise ServeError(429, f"too many requests waiting ({queued} sequences queued, "
                                      f"limit {self.max_waiting}); retry later")
            self._in_flight_adds += n
        self._inbox.put(("add", job))

    def abort(self, job: Job) -> None:
        self._inbox.put(("abort", job))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left (its handlers get 503) and stop the thread."""
        self.close()
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            while self._drain(block=not self._choices and not self.llm.has_unfinished()):
                if self._deadline is not None and time.monotonic() > self._deadline and self._choices:
                    self._fail([c.job for c in self._choices],
                               ServeError(503, "the server shut down before this request finished"))
                self._out.flush()  # acceptances and errors before a step that may be long
                if self.llm.has_unfinished():
                    self._step()
                self._emit()
                self._out.flush()
                self._publish()
        except BaseException as e:  # a bug in the loop itself: /health turns 503
            log.exception("engine loop died")
            self.error = e
            self._fail([c.job for c in self._choices], ServeError(500, f"engine loop died: {e}"))
            self._out.flush()
            return
        self._fail([c.job for c in self._choices], ServeError(503, "the server is shutting down"))
        self._out.flush()
        self._publish()

    def _drain(self, block: bool) -> bool:
        """Handle queued commands (waiting for one when idle); False on stop."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, job = item
            if kind == "stop":
                return False
            if kind == "add":
                self._add(job)
            else:
                self._fail([job], None)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, job: Job) -> None:
        with self._lock:
            self._in_flight_adds -= len(job.prompts)
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
            self._out.post(job, e if isinstance(e, ServeError) else ServeError(400, str(e)))
            return
        self._choices += choices
        self._out.post(job, ACCEPTED)

    def _fail(self, jobs: list[Job], err: ServeError | None) -> None:
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
                self._finished(c, "abort" if err is None else "error")
        self._choices = keep
        if err is not None:
            for j in {id(j): j for j in jobs}.values():
                self._out.post(j, err)

    def _step(self) -> None:
        try:
            self.llm.step()
        except Exception as e:  # noqa: BLE001 - a failed step must not take the server down
            log.exception("engine step failed")
            # the sequences holding KV blocks were in the step; when none does, every one
            # still unfinished, so that a step that keeps failing cannot spin
            live = [c for c in self._choices if not c.seq.finished]
            hit = [c for c in live if c.seq.block_table] or live
            self._fail([c.job for c in hit], ServeError(500, f"engine step failed: {type(e).__name__}: {e}"))

    def _emit(self) -> None:
        now = time.perf_counter()
        keep = []
        for c in self._choices:
            seq = c.seq
            if seq.n_output > c.sent_tokens or seq.finished:
                self._out.post(c.job, self._delta(c))
                if c.first_t is None and c.sent_tokens:
                    c.first_t = now
                    if self.metrics is not None:
                        self.metrics.ttft.observe(now - c.job.t0)
            if seq.finished:
                if self.metrics is not None and c.sent_tokens > 1:
                    self.metrics.tpot.observe((now - c.first_t) / (c.sent_tokens - 1))
                self._finished(c, seq.finish_reason)
            else:
                keep.append(c)
        self._choices = keep

    def _delta(self, c: _Choice) -> Delta:
        seq = c.seq
        ids = seq.output_ids[c.sent_tokens:]
        c.sent_tokens += len(ids)
        lps = seq.logprobs[c.sent_lps:] if seq.logprobs is not None else []
        c.sent_lps += len(lps)
        text = ""
        if self.has_text:
            full = self.llm.visible_text(seq)
            text = full[c.sent_text:]
            c.sent_text = max(c.sent_text, len(full))
        return Delta(c.index, ids, text, lps, seq.finish_reason if seq.finished else None)

    def _finished(self, c: _Choice, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.finished.labels(reason=reason).inc()

    def _publish(self) -> None:
        m = self.llm.metrics()
        running = sum(1 for c in self._choices if c.seq.block_table)
        with self._lock:
            self._engine_waiting = len(self._choices) - running
            waiting = self._engine_waiting + self._in_flight_adds
        self.snapshot = dict(running=running, waiting=waiting, kv_blocks_used=m["kv_blocks_used"],
                             kv_blocks_total=m["kv_blocks_total"], preemptions=m["preemptions"],
                             prompt_tokens=m["prompt_tokens"], generated_tokens=m["generated_tokens"])
