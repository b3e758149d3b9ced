"""Training windows sampled by the engine: prompts continued by `LLM` over a model.

The heal pass's `heal.sampled` windows come from here, handed to the pass as
`PassContext.sampler` by the frontends (`llmc compile`, `llmaccel.compile`): the engine sits
above the passes. Every window is asked for at once, so that the engine batches them (up to
`max_seqs` at a time), temperature 1, each request seeded; then the engine is dropped so that
its KV cache is freed before training starts.
"""
from __future__ import annotations

import gc
import queue
import time

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
                   deliver=None, stop=None, ready=None, begin=None,
                   apart: bool = False) -> tuple[torch.Tensor | None, dict]:
    """(len(prompts), length) token ids: each prompt continued by the engine over `model` with
    temperature-1 samples to `length` tokens (end-of-sequence ignored); request i is seeded with
    (seed, i), so the windows do not depend on how the engine batches them. Also the stats:
    sample_s, sampled_tokens (generated, prompts excluded), sample_tok_s.

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
                                   deliver=deliver, stop=stop, ready=ready, begin=begin)
    t0 = time.perf_counter()
    seqs = max(1, min(len(prompts), max_seqs))
    blocks = -(-length // _BLOCK) + 1
    params = [SamplingParams(temperature=1.0, max_tokens=length - len(p), ignore_eos=True,
                             seed=seed * 1_000_003 + i) for i, p in enumerate(prompts)]
    llm = None
    try:
        llm = LLM(model, kv_cache_tokens=seqs * blocks * _BLOCK, max_num_seqs=seqs, block_size=_BLOCK,
                  enable_prefix_caching=False)
        if deliver is None:
            outs = llm.generate(prompts, params)
        else:
            if str(llm.device).startswith("cuda"):   # temperature 1, no filter: "sample" steps
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


def _stream_apart(model, prompts, length: int, *, seed: int, max_seqs: int, deliver, stop, ready,
                  begin) -> dict:
    """sample_windows' streaming form in a spawned process that loads `model` again from its
    source (same dtype and device): each window comes back over a queue as a list of ids and is
    delivered here; the caller's threading events are relayed to the process's. Raises what the
    process raised (a model that cannot be loaded again from its source included)."""
    import torch.multiprocessing as mp

    mpc = mp.get_context("spawn")
    q = mpc.Queue()
    ev = {k: mpc.Event() for k in ("stop", "ready", "begin")}
    if begin is None:   # nothing to wait for
        ev["begin"].set()
    proc = mpc.Process(target=_apart, name="heal-refresh", daemon=True,
                       args=(model.source, model.dtype, str(model.device), prompts, length, seed,
                             max_seqs, q, ev["stop"], ev["ready"], ev["begin"]))
    proc.start()
    stats: dict = {}
    error = None
    try:
        while True:
            for mine, theirs in ((stop, ev["stop"]), (begin, ev["begin"])):
                if mine is not None and mine.is_set() and not theirs.is_set():
                    theirs.set()
            if ready is not None and ev["ready"].is_set():
                ready.set()
            try:
                item = q.get(timeout=_POLL)
            except queue.Empty:
                if not proc.is_alive() and q.empty():
                    error = error or f"the sampling process ended (exit code {proc.exitcode})"
                    break
                continue
            if item is None:
                break
            if isinstance(item, list):
                deliver(torch.tensor(item, dtype=torch.long))
            elif item[0] == "stats":
                stats = item[1]
            else:
                error = item[1]
    finally:
        if ready is not None:
            ready.set()
        ev["stop"].set()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.terminate()
    if error:
        raise LlmaccelError(f"heal: sampling in a process of its own failed: {error}")
    return stats


def _apart(source: str, dtype, device: str, prompts, length: int, seed: int, max_seqs: int, q,
           stop, ready, begin) -> None:
    """The process of _stream_apart: windows as lists, then ("stats", dict) or ("error", why),
    then None."""
    from llmaccel.compiler.model import load

    try:
        model = load(source, dtype=dtype, device=device)
        stats = sample_windows(model, prompts, length, seed=seed, max_seqs=max_seqs,
                               deliver=lambda w: q.put(w.tolist()), stop=stop, ready=ready,
                               begin=begin)[1]
        q.put(("stats", stats))
    except Exception as e:  # noqa: BLE001 - reported to the caller, which raises it
        q.put(("error", f"{type(e).__name__}: {e}"))
    finally:
        ready.set()
        q.put(None)
