"""Perplexity over non-overlapping windows, and fidelity (KL, top-1) against a baseline."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from llmaccel.errors import LlmaccelError
from llmaccel.eval.domains import ppl_of, window_batches

def resolve_chunk(model, chunk: int | None) -> int | None:
    """None: the model's own way (`eval_chunk`: a whole-window forward, unless the graph
    quantizes its KV cache)."""
    if chunk is None:
        return model.eval_chunk
    if chunk < 1:
        raise LlmaccelError(f"--chunk must be positive, got {chunk}")
    return chunk


def window_logits(model, x: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Logits (B, T, V) for ids x (B, T): one forward, or chunk by chunk through the model's cache."""
    if chunk is None:
        return model.logits(x)
    cache = model.new_cache(x.shape[0], x.shape[1])
    parts = [model.logits(x[:, s: s + chunk], s, cache) for s in range(0, x.shape[1], chunk)]
    return torch.cat(parts, 1)


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, *, ctx: int = 512, baseline=None, progress: bool = True,
             chunk: int | None = None, batch: int = 4) -> dict:
    """Windows s = 0, ctx, 2ctx, ...: predict ids[s+1 : s+ctx+1] from ids[s : s+ctx].

    `chunk`: run each window as a chunked prefill through the KV cache (default: only for
    graphs that quantize their KV cache, with chunks of 32; the baseline by its own graph).
    Chunked windows run `batch` at a time (independent rows of one cache), since many
    32-token forwards are slow on a CPU otherwise.

    ppl = exp(total NLL / predicted tokens). With a baseline: mean KL(baseline || model) and
    top-1 agreement over the same positions.
    """
    chunk = resolve_chunk(model, chunk)
    base_chunk = resolve_chunk(baseline, None) if baseline is not None else None
    nll, n, kl, agree, base_nll = 0.0, 0, 0.0, 0, 0.0
    n_windows = len(range(0, len(ids) - 1, ctx))
    size = batch if chunk is not None or base_chunk is not None else 1
    bar = tqdm(total=n_windows, desc="eval", unit="win", disable=not progress, file=sys.stderr)
    for x, y in window_batches(ids, ctx, size):
        logits = window_logits(model, x, chunk).float().flatten(0, 1)
        y = y.flatten().to(logits.device)
        nll += F.cross_entropy(logits, y, reduction="sum").item()
        n += len(y)
        if baseline is not None:
            base = window_logits(baseline, x, base_chunk).float().flatten(0, 1).to(logits.device)
            base_nll += F.cross_entropy(base, y, reduction="sum").item()
            lp_b, lp_m = base.log_softmax(-1), logits.log_softmax(-1)
            kl += (lp_b.exp() * (lp_b - lp_m)).sum(-1).sum().item()
            agree += (base.argmax(-1) == logits.argmax(-1)).sum().item()
        bar.update(x.shape[0])
    bar.close()
    out = {"ppl": ppl_of(nll / n), "nll": nll / n, "tokens": n, "windows": n_windows, "ctx": ctx,
           "chunk": chunk}
    if baseline is not None:
        # The baseline's own perplexity comes free with its logits (no second pass over the text).
        out.update(kl=kl / n, top1=agree / n, baseline_ppl=ppl_of(base_nll / n))
    return out
