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


STAT_ROWS = 2048  # rows of logits whose log-softmax copies exist at once


def window_stats(logits: torch.Tensor, y: torch.Tensor, base: torch.Tensor | None) -> tuple:
    """(NLL sum, the baseline's NLL sum, KL(base || model) sum, top-1 agreements) over rows."""
    nll = F.cross_entropy(logits, y, reduction="sum").item()
    if base is None:
        return nll, 0.0, 0.0, 0
    lp_b, lp_m = base.log_softmax(-1), logits.log_softmax(-1)
    return (nll, F.cross_entropy(base, y, reduction="sum").item(),
            (lp_b.exp() * (lp_b - lp_m)).sum().item(), (base.argmax(-1) == logits.argmax(-1)).sum().item())


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, *, ctx: int = 512, baseline=None, progress: bool = True,
             chunk: int | None = None, batch: int = 4) -> dict:
    """Windows s = 0, ctx, 2ctx, ...: predict ids[s+1 : s+ctx+1] from ids[s : s+ctx].

    `chunk`: run each window as a chunked prefill through the KV cache (default: only for
    graphs that quantize their KV cache, model.eval_chunk: 32 for KIVI, 512 for int8 rows; the
    baseline by its own graph).
    Chunked windows run `batch` at a time (independent rows of one cache), since many
    32-token forwards are slow on a CPU otherwise; at most 8,192 tokens at a time (ctx 4,096: 2
    windows), and the statistics are taken over slices of rows: a batch's logits are B x ctx x
    vocabulary floats (3.2 GB for SmolLM2 at 4 x 4,096), each copy of them a share of the memory.

    ppl = exp(total NLL / predicted tokens). With a baseline: mean KL(baseline || model) and
    top-1 agreement over the same positions.
    """
    chunk = resolve_chunk(model, chunk)
    base_chunk = resolve_chunk(baseline, None) if baseline is not None else None
    nll, n, kl, agree, base_nll = 0.0, 0, 0.0, 0, 0.0
    n_windows = len(range(0, len(ids) - 1, ctx))
    size = max(1, min(batch, 8192 // ctx)) if chunk is not None or base_chunk is not None else 1
    bar = tqdm(total=n_windows, desc="eval", unit="win", disable=not progress, file=sys.stderr)
    for x, y in window_batches(ids, ctx, size):
        logits = window_logits(model, x, chunk).float().flatten(0, 1)
        y = y.flatten().to(logits.device)
        base = None
        if baseline is not None:
            base = window_logits(baseline, x, base_chunk).float().flatten(0, 1).to(logits.device)
        for i in range(0, len(y), STAT_ROWS):
            s = window_stats(logits[i:i + STAT_ROWS], y[i:i + STAT_ROWS],
                             None if base is None else base[i:i + STAT_ROWS])
            nll, base_nll, kl, agree = nll + s[0], base_nll + s[1], kl + s[2], agree + s[3]
        n += len(y)
        bar.update(x.shape[0])
    bar.close()
    out = {"ppl": ppl_of(nll / n), "nll": nll / n, "tokens": n, "windows": n_windows, "ctx": ctx,
           "chunk": chunk}
    if baseline is not None:
        # The baseline's own perplexity comes free with its logits (no second pass over the text).
        out.update(kl=kl / n, top1=agree / n, baseline_ppl=ppl_of(base_nll / n))
    return out
