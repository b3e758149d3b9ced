"""The OpenAI-compatible HTTP API over one engine loop: routes, errors, streaming, auth."""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from llmaccel.serve.loop import ACCEPTED, EngineThread, Frontend, Job, ServeError
from llmaccel.serve.metrics import ServeMetrics
from llmaccel.serve.protocol import (ChatRequest, Choices, CompletionRequest, Envelope, TokenNames,
                                     usage)


class ClientGone(Exception):
    pass


async def _watch(job: Job, receive) -> None:
    """Mark the job gone when its client closes the connection. The body has been read, so the
    server's next message is http.disconnect: when the client leaves, or (uvicorn) once the
    response is complete; the handler cancels this task when it is done with the job."""
    while (await receive())["type"] != "http.disconnect":
        pass
    job.gone = True
    job.events.wake()


class EventStream(Response):
    """Server-sent events from an async iterator of str. Starlette's StreamingResponse also
    listens for the disconnect in an anyio task group, whose cancel formats a task's repr (a
    good part of the ~0.3 ms per stream it cost the event loop); here the job's own watch task
    does that (a client that leaves ends the iterator, which aborts the job). on_close runs
    however the response ends, even before the iterator started."""

    media_type = "text/event-stream"

    def __init__(self, chunks, on_close):
        self.chunks, self.on_close, self.status_code, self.background = chunks, on_close, 200, None
        self.init_headers(None)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.chunks.aclose()
            self.on_close()


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    errs = e.errors()
    if errs and errs[0]["type"] == "json_invalid":
        return f"the body is not valid JSON: {errs[0]['ctx'].get('error', '')}", None
    param = str(errs[0]["loc"][0]) if errs and errs[0]["loc"] else None
    shown = []
    for err in errs:
        line = f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}"
        if line not in shown:
            shown.append(line)
    return "invalid request: " + "; ".join(shown[:3]), param


class Server:
    """The state the routes share: the engine loop, its model's facts, metrics, the API key."""

    def __init__(self, engine, *, name: str, api_key: str | None = None, max_waiting: int = 1024):
        """engine: a Frontend (EngineProcess for `llmc serve`), or an LLM run on a thread."""
        self.name, self.api_key = name, api_key
        self.metrics = ServeMetrics()
        self.loop = engine if isinstance(engine, Frontend) else EngineThread(engine)
        self.loop.metrics, self.loop.max_waiting = self.metrics, max_waiting
        self.metrics.watch(self.loop)
        facts = self.loop.facts
        self.ctx, self.vocab = facts["max_position"], facts["vocab_size"]
        self.tokenizer = None
        if facts["tokenizer_dir"] is not None:
            # a copy of its own: the engine decodes with the model's at the same time
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(facts["tokenizer_dir"])
        self.names = TokenNames(self.tokenizer)

    # -------------------------------------------------------------- request checks
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise ServeError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                             code="invalid_api_key")

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ServeError(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                             param="model", code="model_not_found")

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            # min and max run in C: a Python loop over a 1,000-token prompt took ~0.15 ms
            bad = next((t for t in prompt if not 0 <= t < self.vocab), None) if prompt and (
                min(prompt) < 0 or max(prompt) >= self.vocab) else None
            if bad is not None:
                raise ServeError(400, f"token id {bad} is outside the vocabulary (0..{self.vocab - 1})",
                                 param="prompt")
            return prompt
        return self.tokenizer_or_400()(prompt).input_ids

    def tokenizer_or_400(self):
        if self.tokenizer is None:
            raise ServeError(400, f"{self.name} has no tokenizer: send prompts as lists of token ids "
                                  f"to /v1/completions", param="prompt")
        return self.tokenizer

    def chat_ids(self, req: ChatRequest) -> list[int]:
        tok = self.tokenizer_or_400()
        if not getattr(tok, "chat_template", None):
            raise ServeError(400, f"{self.name}'s tokenizer has no chat template", param="messages")
        try:
            text = tok.apply_chat_template(req.messages_for_template(), add_generation_prompt=True,
                                           tokenize=False)
        except Exception as e:  # noqa: BLE001 - the template rejects these messages (jinja)
            raise ServeError(400, f"the chat template rejects these messages: {e}", param="messages") from None
        return tok(text, add_special_tokens=False).input_ids

    def max_tokens(self, ids: list[int], asked: int | None, param: str, prompt_param: str) -> int:
        """The tokens this prompt may generate: as asked, or up to the context's end."""
        room = self.ctx - len(ids)
        if room < 1:
            raise ServeError(400, f"the prompt has {len(ids)} tokens; the model context is {self.ctx} "
                                  f"(prompt plus at least one new token must fit)", param=prompt_param)
        if asked is not None and asked > room:
            raise ServeError(400, f"the prompt has {len(ids)} tokens and {param} is {asked}: "
                                  f"{len(ids) + asked} exceeds the model context of {self.ctx} tokens",
                             param=param)
        return room if asked is None else asked

    def check_stop(self, stop) -> None:
        if stop and self.tokenizer is None:
            raise ServeError(400, f"stop strings need a tokenizer; {self.name} has none", param="stop")

    # -------------------------------------------------------------- talking to the engine
    async def _next(self, job: Job):
        """The job's next event; ClientGone once its client has closed the connection."""
        while True:
            if job.gone:
                raise ClientGone
            try:
                return job.events.get_nowait()
            except asyncio.QueueEmpty:
                pass
            await job.events.wait()

    def _release(self, job: Job) -> None:
        """The handler is done with the job: abort what still runs, stop watching the client
        (once; later calls do nothing)."""
        if not job.done:
            job.done = True  # an abort is sent once
            self.loop.abort(job)
        job.watch.cancel()

    async def start(self, prompts, params, request: Request) -> Job:
        """Submit a job and wait until the engine took it (its errors are raised here)."""
        job = Job(prompts, params)
        self.loop.submit(job)
        job.watch = asyncio.ensure_future(_watch(job, request.receive))
        try:
            item = await self._next(job)
        except BaseException:
            self._release(job)
            raise
        if isinstance(item, ServeError):
            job.done = True
            self._release(job)
            raise item
        assert item == ACCEPTED, item
        return job

    async def deltas(self, job: Job):
        left = len(job.prompts)
        while left:
            item = await self._next(job)
            if isinstance(item, ServeError):
                job.done = True
                raise item
            left -= item.finish_reason is not None
            if not left:
                job.done = True
            yield item

    async def collect(self, job: Job) -> Choices:
        out = Choices(len(job.prompts))
        try:
            async for d in self.deltas(job):
                out.add(d)
        finally:
            self._release(job)
        return out

    async def stream(self, job: Job, env: Envelope, chunk, n_prompt: int, include_usage: bool):
        tokens, out = 0, []
        try:
            try:
                async for d in self.deltas(job):
                    tokens += len(d.token_ids)
                    out.append(_sse(env.body([chunk(d)])))
                    if job.events.empty():  # what came in one engine turn goes out in one write
                        yield "".join(out)
                        out = []
                if include_usage:
                    out.append(_sse(env.body([], usage=usage(n_prompt, tokens))))
            except ServeError as e:  # after the 200 went out: an error event, then the end
                out.append(_sse(e.body))
            yield "".join(out) + "data: [DONE]\n\n"
        except ClientGone:
            pass
        finally:  # the client went away (the generator was closed) or the job ended
            self._release(job)

    async def parse(self, request: Request, cls):
        """The checks every generation request passes before it reaches the engine."""
        self.check_key(request)
        try:
            req = cls.model_validate_json(await request.body())
        except ValidationError as e:
            msg, param = _validation_message(e)
            raise ServeError(400, msg, param=param) from None
        self.check_model(req.model)
        req.unsupported()
        self.check_stop(req.stop)
        return req

    async def reply(self, job: Job, req, env: Envelope, chunk, whole, n_prompt: int):
        """A stream of chunk(delta) events, or the whole response from whole(choices)."""
        if req.stream:
            return self.respond(EventStream(self.stream(job, env, chunk, n_prompt, req.include_usage),
                                            on_close=lambda: self._release(job)))
        out = await self.collect(job)
        return self.respond(env.body(whole(out), usage=usage(n_prompt, sum(out.tokens))))

    def respond(self, body: dict | Response) -> Response:
        self.metrics.requests.labels(status="200").inc()
        return body if isinstance(body, Response) else JSONResponse(body)

    def error(self, e: ServeError) -> JSONResponse:
        self.metrics.requests.labels(status=str(e.status)).inc()
        return JSONResponse(e.body, status_code=e.status)


def create_app(engine, *, name: str, api_key: str | None = None, max_waiting: int = 1024) -> FastAPI:
    """The app over `engine`: an EngineProcess, or an LLM (run on a thread of this process)."""
    s = Server(engine, name=name, api_key=api_key, max_waiting=max_waiting)

    @asynccontextmanager
    async def lifespan(app):
        s.loop.start()
        yield
        s.loop.shutdown()

    app = FastAPI(title="llmaccel", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = s
    _error_handlers(app, s)
    _info_routes(app, s)
    # Starlette routes: FastAPI's parameter machinery (dependencies, telemetry) took ~0.2 ms
    # of each request, and these handlers read the request themselves
    app.add_route("/v1/completions", _completions(s), methods=["POST"])
    app.add_route("/v1/chat/completions", _chat(s), methods=["POST"])
    return app


def _error_handlers(app: FastAPI, s: Server) -> None:
    @app.exception_handler(ServeError)
    async def _serve_error(request, e: ServeError):
        return s.error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return s.error(ServeError(e.status_code, str(e.detail)))

    @app.exception_handler(ClientGone)
    async def _gone(request, e: ClientGone):  # nobody reads this; counted as nginx does
        s.metrics.requests.labels(status="499").inc()
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        return s.error(ServeError(500, f"internal error: {type(e).__name__}: {e}"))


def _info_routes(app: FastAPI, s: Server) -> None:
    @app.get("/health")
    async def health():
        if not s.loop.alive:
            return s.error(ServeError(503, f"the engine loop has stopped: {s.loop.error!r}"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        s.check_key(request)
        return s.respond({"object": "list", "data": [
            {"id": s.name, "object": "model", "created": int(time.time()), "owned_by": "llmaccel",
             "max_model_len": s.ctx}]})


def _completions(s: Server):
    async def completions(request: Request):
        req = await s.parse(request, CompletionRequest)
        prompts = [s.encode(p) if isinstance(p, list) else await asyncio.to_thread(s.encode, p)
                   for p in req.prompts]
        ids = [p for p in prompts for _ in range(req.n)]
        params = [req.params(s.max_tokens(p, req.max_tokens, "max_tokens", "prompt"), i % req.n, req.logprobs)
                  for i, p in enumerate(ids)]
        job = await s.start(ids, params, request)
        offsets = [0] * len(ids)

        def lp(i, entries):
            if req.logprobs is None:
                return None
            out = s.names.completion_logprobs(entries, offsets[i])
            offsets[i] += sum(map(len, out["tokens"]))
            return out

        def chunk(d):
            return {"index": d.index, "text": d.text, "logprobs": lp(d.index, d.logprobs),
                    "finish_reason": d.finish_reason}

        def whole(out: Choices):
            return [{"index": i, "text": out.text[i], "logprobs": lp(i, out.logprobs[i]),
                     "finish_reason": out.finish[i]} for i in range(len(ids))]

        env = Envelope("cmpl", "text_completion", s.name)
        return await s.reply(job, req, env, chunk, whole, sum(map(len, prompts)))

    return completions


def _chat(s: Server):
    async def chat(request: Request):
        req = await s.parse(request, ChatRequest)
        # off the event loop: the tokenizer (Rust) releases the GIL, the other streams go on
        prompt = await asyncio.to_thread(s.chat_ids, req)
        asked, param = ((req.max_completion_tokens, "max_completion_tokens")
                        if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
        mt = s.max_tokens(prompt, asked, param, "messages")
        job = await s.start([prompt] * req.n, [req.params(mt, i, req.wanted_logprobs()) for i in range(req.n)],
                            request)
        started = set()

        def lp(entries):
            return s.names.chat_logprobs(entries) if req.logprobs else None

        def chunk(d):
            delta = {"content": d.text}
            if d.index not in started:
                started.add(d.index)
                delta["role"] = "assistant"
            return {"index": d.index, "delta": delta, "logprobs": lp(d.logprobs), "finish_reason": d.finish_reason}

        def whole(out: Choices):
            return [{"index": i, "message": {"role": "assistant", "content": out.text[i]},
                     "logprobs": lp(out.logprobs[i]), "finish_reason": out.finish[i]} for i in range(req.n)]

        env = Envelope("chatcmpl", "chat.completion.chunk" if req.stream else "chat.completion", s.name)
        return await s.reply(job, req, env, chunk, whole, len(prompt))

    return chat
