"""LLM.warmup: compile and capture, before any request, the step shapes a load meets.

The decode runner's graphs of every batch bucket and width up to a context in every sampling
mode, the step graphs of a lone prompt, and a few mixed steps over the scratch block alone whose
only purpose is to compile the eager steps' kernel variants (a server runs this before it
answers, so that no request waits for a compile in the middle of a load).
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

from llmaccel.errors import LlmaccelError
from llmaccel.runtime.decode import WARM_MODES
from llmaccel.runtime.kv_cache import PagedKVCache, build_step

WARM_PROMPTS = (8, 40, 47)


def eager_warm_steps(context: int) -> list[tuple[int, int]]:
    """(decode row's context, prompt tokens) of each mixed step warm_eager_steps runs: the
    context at 256 x 2^k tokens up to `context` (the decode attention's split count, and the
    compiled merge of its splits, grow with the context: a split is 256 tokens or more) beside
    a prompt of 8, 40 and 47 tokens (the prefill attention's two tile heights; steps of 41 and
    48 tokens, for kernels specialized on whether a count divides by 16, such as the int4 and
    int8 GEMMs' rows), all within `context` positions."""
    out, L = [], 256
    while True:
        L = min(L, context)
        out += [(L, p) for p in sorted({min(p, context) for p in WARM_PROMPTS})]
        if L >= context:
            return out
        L *= 2


def warm_eager_steps(gm, cache: PagedKVCache, scratch: int, context: int, bar=None) -> int:
    """Run the mixed steps of eager_warm_steps(context) over the scratch block alone (every slot
    and table entry there; outputs discarded), so that the kernel variants of eager prefill and
    mixed steps are compiled before any request. How many (bar: a progress bar)."""
    bs, device = cache.block_size, cache.device
    steps = eager_warm_steps(context)
    for L, prompt in steps:
        items = [([scratch] * -(-L // bs), L - 1, [0]), ([scratch] * -(-prompt // bs), 0, [0] * prompt)]
        ids, pos, ctx = build_step(cache, items, [1, 1], device)
        gm(ids, pos, ctx)
        if bar is not None:
            bar.update(1)
    return len(steps)


def warm_up(core, context: int, progress: bool, modes: tuple[str, ...] | None = None) -> dict:
    """LLM.warmup's work on its engine core (it runs in inference mode, as steps do)."""
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise LlmaccelError(f"warm-up context must be a positive number of tokens, got {context!r}")
    modes = WARM_MODES if modes is None else tuple(dict.fromkeys(modes))
    if not modes or any(m not in WARM_MODES for m in modes):
        raise LlmaccelError(f"warm-up modes must be some of {', '.join(WARM_MODES)}, got {modes!r}")
    t0 = time.perf_counter()
    context = min(context, core.cfg.max_position)
    decode, steps = core.runner.decode, core.runner.steps
    capture = decode is not None and decode.capture
    shapes = [(decode, k) for k in decode.warm_keys(modes, context)] if capture else []
    if steps is not None and steps.capture:
        shapes += [(steps, k) for k in steps.warm_keys()]
    # the mixed steps below run on the paged cache's scratch block
    paged = capture and core.backend.name == "paged"
    eager = len(eager_warm_steps(context)) if paged else 0
    with tqdm(total=len(shapes) + eager, desc="warming up step shapes", unit="shape", file=sys.stderr,
              disable=not progress or not shapes) as bar:
        for runner, key in shapes:
            runner.graph(key)
            bar.update(1)
        if paged:  # the eager steps' kernels too
            warm_eager_steps(core.runner.gm, core.cache, core.cache.num_blocks - 1, context, bar)
    return {"shapes": len(shapes) + eager, "seconds": round(time.perf_counter() - t0, 3)}
