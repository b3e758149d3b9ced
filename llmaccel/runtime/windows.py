"""Training windows sampled by the engine: prompts continued by `LLM` over a model.

The heal pass's `heal.sampled` windows come from here, handed to the pass as
`PassContext.sampler` by the frontends (`llmc compile`, `llmaccel.compile`): the engine sits
above the passes. Every window is asked for at once, so that the engine batches them (up to
`max_seqs` at a time), temperature 1 and no top-p filter unless asked, each request seeded;
then the engine is dropped so that its KV cache is freed before training starts. `heal.refresh`'s windows stream from here while
training runs, from a thread of the heal or from a child Python that runs this module's
_child.
"""
from __future__ import annotations

import contextlib
import gc
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import torch

from llmaccel.errors import LlmaccelError
from llmaccel.runtime.engine import LLM
from llmaccel.sampling import SamplingParams, sample_mode

_BLOCK = 16  # the engine's KV block size


def _release(device) -> None:
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


@torch.no_grad()
def sample_windows(model, prompts: list[list[int]], length: int, *, seed: int, max_seqs: int,
                   temperature: float = 1.0, top_p: float = 1.0, deliver=None, stop=None,
                   ready=None, begin=None, apart: bool = False) -> tuple[torch.Tensor | None, dict]:
    """(len(prompts), length) token ids: each prompt continued by the engine over `model` with
    samples (temperature, top_p) to `length` tokens (end-of-sequence ignored); request i is
    seeded with (seed, i), so the windows do not depend on how the engine batches them. Also the
    stats: sample_s, sampled_tokens (generated, prompts excluded), sample_tok_s.

    Streaming (the heal's `heal.refresh`, run on a thread beside training): deliver(window) gets
    each (length,) window as its request finishes, in finishing order, and None comes back in
    place of the windows; stop (a threading.Event) ends it early, ready (an Event) is set once
    the engine has captured its step graphs (CUDA: LLM.warmup for `length` tokens), so the
    caller can keep its own device work out of the captures; begin (an Event), when given, holds
    the requests back until it is set (the heal sets it once its first step has compiled: the
    engine's Python loop on a thread would otherwise slow Inductor's compilation by sharing the
    interpreter with it, 110 s instead of ~64 s for a SmolLM2 step on an H200).
    apart (streaming only): the engine runs in a process of its own (_stream_apart), so that its
    Python loop does not share an interpreter with the caller's."""
    if any(not 0 < len(p) < length for p in prompts):
        raise LlmaccelError(f"heal: every prompt must be 1..{length - 1} tokens long")
    if apart and deliver is not None:
        return None, _stream_apart(model, prompts, length, seed=seed, max_seqs=max_seqs,
                                   temperature=temperature, top_p=top_p, deliver=deliver,
                                   stop=stop, ready=ready, begin=begin)
    t0 = time.perf_counter()
    seqs = max(1, min(len(prompts), max_seqs))
    blocks = -(-length // _BLOCK) + 1
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=length - len(p),
                             ignore_eos=True, seed=seed * 1_000_003 + i) for i, p in enumerate(prompts)]
    llm = None
    try:
        llm = LLM(model, kv_cache_tokens=seqs * blocks * _BLOCK, max_num_seqs=seqs, block_size=_BLOCK,
                  enable_prefix_caching=False)
        if deliver is None:
            outs = llm.generate(prompts, params)
        else:
            if str(llm.device).startswith("cuda"):   # the step graphs of these params' mode
                llm.warmup(context=length, modes=(sample_mode(params),))
            if ready is not None:
                ready.set()
            while begin is not None and not begin.wait(0.05):
                if stop is not None and stop.is_set():
                    break
            # the rate counts sampling from here: not the start-up, nor the wait for `begin`
            return None, _stream(llm, prompts, params, deliver, stop, seqs, time.perf_counter())
    finally:
        if ready is not None:
            ready.set()  # also when the engine failed to start: the caller must not wait on it
        del llm
        _release(model.device)
    bad = next((o for o in outs if o.finish_reason != "length"), None)
    if bad is not None:
        raise LlmaccelError(f"heal: sampling a training window failed: {bad.error or bad.finish_reason}")
    windows = torch.tensor([o.prompt_token_ids + o.token_ids for o in outs], dtype=torch.long)
    seconds = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outs)
    return windows, {"sample_s": round(seconds, 3), "sampled_tokens": generated,
                     "sample_tok_s": round(generated / max(seconds, 1e-9), 1)}


def _stream(llm, prompts, params, deliver, stop, seqs: int, t0: float) -> dict:
    """Requests fed to the engine two batches ahead, each window delivered as it finishes."""
    todo = list(zip(prompts, params))[::-1]
    live: list = []
    generated = done = 0
    while (todo or live) and not (stop is not None and stop.is_set()):
        while todo and len(live) < 2 * seqs:
            live.append(llm.add_request(*todo.pop()))
        llm.step()
        ended = [s for s in live if s.finished]
        if ended:   # one pass over the live requests (512 of them), not a removal per request
            live = [s for s in live if not s.finished]
        for s in ended:
            out = llm.output(s)
            if out.finish_reason != "length":
                raise LlmaccelError(f"heal: sampling a training window failed: {out.error or out.finish_reason}")
            deliver(torch.tensor(out.prompt_token_ids + out.token_ids, dtype=torch.long))
            generated += len(out.token_ids)
            done += 1
    seconds = time.perf_counter() - t0
    return {"sample_s": round(seconds, 3), "sampled_tokens": generated, "windows": done,
            "sample_tok_s": round(generated / max(seconds, 1e-9), 1)}


_POLL = 0.05  # seconds between the relay's looks at the caller's events
_STOP_GRACE = 30.0  # seconds the child has to end once told to stop, before it is killed


def _stream_apart(model, prompts, length: int, *, seed: int, max_seqs: int, temperature: float,
                  top_p: float, deliver, stop, ready, begin) -> dict:
    """sample_windows' streaming form in a child Python (running _child) that loads `model`
    again from its source (same dtype and device): each window comes back as a list of ids over
    a pipe and is delivered here; the caller's begin and stop go to it over another. Not a
    multiprocessing spawn: that runs the caller's main script again in the child, all of it where
    the script has no `if __name__ == "__main__"` guard. Raises what the child raised (a model
    that cannot be loaded again from its source included)."""
    proc, back, ctl = _spawn_child()
    stats, error = None, None
    told: dict[str, float] = {}   # message -> when it was sent
    try:
        ctl.send((model.source, str(model.dtype).removeprefix("torch."), str(model.device), prompts,
                  length, seed, max_seqs, temperature, top_p))
        stats, error = _relay(proc, back, ctl, told, deliver=deliver, stop=stop, ready=ready, begin=begin)
    except OSError:   # the child went before it read what it was sent
        error = error or f"the sampling process ended (exit code {proc.wait()})"
    finally:
        _end_child(proc, back, ctl, ready)
    if error is None and stats is None and "stop" not in told:
        error = "the sampling process ended without its figures"
    if error:
        raise LlmaccelError(f"heal: sampling in a process of its own failed: {error}")
    return stats or {}


def _spawn_child():
    """(process, its connection back here, the control connection to it) of a child running _child.
    child -> here: ("windows", [ids, ...]), ("ready",), ("stats", d), ("error", why), then None;
    here -> child: the arguments, then "begin", "stop"."""
    from multiprocessing.connection import Connection

    back_r, back_w = os.pipe()
    ctl_r, ctl_w = os.pipe()
    # `-c`, not `-m` (which imports the package, and so this module, before running it again);
    # this checkout's llmaccel ahead of the working directory's; a session of its own, so that
    # a Ctrl-C reaches the parent only, which then stops it
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
            f"from llmaccel.runtime.windows import _child; _child({ctl_r}, {back_w})")
    try:
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(ctl_r, back_w),
                                start_new_session=True)
    except BaseException:
        for fd in (back_r, back_w, ctl_r, ctl_w):
            os.close(fd)
        raise
    os.close(ctl_r)
    os.close(back_w)
    return proc, Connection(back_r, writable=False), Connection(ctl_w, readable=False)


def _relay(proc, back, ctl, told: dict, *, deliver, stop, ready, begin) -> tuple[dict | None, str | None]:
    """Pass begin / stop to the child as they are set and its windows to `deliver` until it ends:
    (its stats, the error it or its end gave)."""
    got: dict = {"stats": None, "error": None}
    try:
        while _relay_one(proc, back, ctl, told, got, deliver, stop, ready, begin):
            pass
    except OSError:   # the child went before it read what it was sent
        got["error"] = got["error"] or f"the sampling process ended (exit code {proc.wait()})"
    return got["stats"], got["error"]


def _relay_one(proc, back, ctl, told, got, deliver, stop, ready, begin) -> bool:
    """One round of _relay; whether to go on."""
    due = {"begin": begin is None or begin.is_set(), "stop": stop is not None and stop.is_set()}
    for name in [n for n, now in due.items() if now and n not in told]:
        ctl.send(name)
        told[name] = time.monotonic()
    if "stop" in told and time.monotonic() - told["stop"] > _STOP_GRACE:
        proc.kill()   # stuck where it cannot look at "stop" (loading, warming up)
        return False
    if not back.poll(_POLL):
        if proc.poll() is not None and not back.poll(0):
            got["error"] = got["error"] or f"the sampling process ended (exit code {proc.returncode})"
            return False
        return True
    try:
        item = back.recv()
    except EOFError:
        got["error"] = got["error"] or f"the sampling process ended (exit code {proc.wait()})"
        return False
    if item is None:
        return False
    if item[0] == "windows":
        for w in item[1]:
            deliver(torch.tensor(w, dtype=torch.long))
    elif item[0] == "ready":
        if ready is not None:
            ready.set()
    elif item[0] == "stats":
        got["stats"] = item[1]
    else:
        got["error"] = item[1]
    return True


def _end_child(proc, back, ctl, ready) -> None:
    """Tell the child to stop (if it still listens), close both ends and wait for it (a minute)."""
    if ready is not None:
        ready.set()
    try:
        ctl.send("stop")
    except OSError:   # the child has gone already
        pass
    ctl.close()
    back.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _Told:
    """An Event-like flag that sends ("ready",) back once when set (sample_windows' `ready`)."""

    def __init__(self, out: queue.SimpleQueue):
        self.out, self.done = out, False

    def set(self) -> None:
        if not self.done:
            self.done = True
            self.out.put(("ready",))


def _send_all(back, out: queue.SimpleQueue) -> None:
    """Sends what `out` gets, in order, until None; windows waiting together go as one message.
    On a thread of its own, so that the engine's loop never waits on the pipe (the engine
    finishes a whole batch of windows at one step; the parent reads them between its
    training step's launches)."""
    while True:
        items = [out.get()]
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(out.get_nowait())
        wins: list = []
        for item in items:
            if item is not None and item[0] == "windows":
                wins += item[1]
                continue
            if wins:
                back.send(("windows", wins))
                wins = []
            back.send(item)
            if item is None:
                return
        if wins:
            back.send(("windows", wins))


def _child(ctl_fd: int, back_fd: int) -> None:
    """The child of _stream_apart: reads its arguments, then samples, sending the windows back
    as lists; "begin" and "stop" (or the pipe's end) from the parent set the events."""
    import threading
    from multiprocessing.connection import Connection

    from llmaccel.compiler.model import load

    ctl, back = Connection(ctl_fd, writable=False), Connection(back_fd, readable=False)
    stop, begin = threading.Event(), threading.Event()
    out: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_send_all, args=(back, out), daemon=True)
    sender.start()

    def listen():
        try:
            while (msg := ctl.recv()) != "stop":
                if msg == "begin":
                    begin.set()
        except (EOFError, OSError):
            pass
        stop.set()
        begin.set()

    try:
        source, dtype, device, prompts, length, seed, max_seqs, temperature, top_p = ctl.recv()
        threading.Thread(target=listen, daemon=True).start()
        model = None if stop.is_set() else load(source, dtype=dtype, device=device)
        stats = {} if stop.is_set() else sample_windows(model, prompts, length, seed=seed, max_seqs=max_seqs,
                               temperature=temperature, top_p=top_p,
                               deliver=lambda w: out.put(("windows", [w.tolist()])), stop=stop,
                               ready=_Told(out), begin=begin)[1]
        out.put(("stats", stats))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        out.put(("error", f"{type(e).__name__}: {e}"))
    finally:
        out.put(None)
        sender.join()
        back.close()

