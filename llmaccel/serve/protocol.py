"""OpenAI request models (validated by pydantic, unknown fields ignored) and response bodies."""
from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from llmaccel.errors import LlmaccelError
from llmaccel.sampling import MAX_LOGPROBS, SamplingParams
from llmaccel.serve.loop import Delta, ServeError

MAX_N = 128


class _Base(BaseModel):
    # strict: "0.5" is not a temperature, as OpenAI answers; unknown fields are ignored as it does
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


class _Sampling(_Base):
    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM spells it -1); SamplingParams bounds it
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    def unsupported(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ServeError(400, f"{name} is not supported (only 0)", param=name)

    def params(self, max_tokens: int, index: int, logprobs: int | None) -> SamplingParams:
        """The SamplingParams of choice `index` (a given seed is offset per choice, so n
        seeded choices differ and stay reproducible)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else float(self.temperature),
                top_p=1.0 if self.top_p is None else float(self.top_p),
                top_k=max(0, self.top_k or 0), max_tokens=max_tokens,
                seed=None if self.seed is None else self.seed + index, stop=stop or None,
                ignore_eos=self.ignore_eos, logprobs=logprobs)
        except LlmaccelError as e:
            raise ServeError(400, str(e)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo or self.suffix:
            raise ServeError(400, "echo and suffix are not supported", param="echo" if self.echo else "suffix")

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) or not p else list(p)


class ContentPart(_Base):
    type: str
    text: str | None = None


class ChatMessage(_Base):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" or p.text is None for p in self.content):
            raise ServeError(400, "only text content parts are supported", param="messages")
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def messages_for_template(self) -> list[dict]:
        # "developer" is OpenAI's newer name for "system"; templates know the old one
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Envelope:
    """id, object, created and model, shared by every chunk of one response."""

    def __init__(self, prefix: str, kind: str, model: str):
        self.id, self.kind, self.model, self.created = new_id(prefix), kind, model, int(time.time())

    def body(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}


class TokenNames:
    """Token ids as the strings logprobs show: decoded text, or `token_id:N` without a tokenizer."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def __call__(self, t: int) -> str:
        return self.tok.decode([t]) if self.tok is not None else f"token_id:{t}"

    def completion_logprobs(self, entries: list[dict], offset: int) -> dict:
        """The completions API's columns: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens = [self(e["token"]) for e in entries]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self(t): lp for t, lp in e["top"]} for e in entries],
                "text_offset": offsets}

    def chat_logprobs(self, entries: list[dict]) -> dict:
        def item(t, lp):
            s = self(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [{**item(e["token"], e["logprob"]),
                             "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]}


class Choices:
    """What the deltas of every choice add up to, for a whole (non-streamed) response."""

    def __init__(self, n: int):
        self.text = [""] * n
        self.tokens = [0] * n
        self.logprobs: list[list[dict]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n

    def add(self, d: Delta) -> None:
        self.text[d.index] += d.text
        self.tokens[d.index] += len(d.token_ids)
        self.logprobs[d.index] += d.logprobs
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)
