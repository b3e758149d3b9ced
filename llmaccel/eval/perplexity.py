"""Perplexity over non-overlapping windows, and fidelity (KL, top-1) against a baseline."""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, *, ctx: int = 512, baseline=None, progress: bool = True) -> dict:
    """Windows s = 0, ctx, 2ctx, ...: predict ids[s+1 : s+ctx+1] from ids[s : s+ctx].

    ppl = exp(total NLL / predicted tokens). With a baseline: mean KL(baseline || model) and
    top-1 agreement over the same positions.
    """
    nll, n, kl, agree = 0.0, 0, 0.0, 0
    starts = list(range(0, len(ids) - 1, ctx))
    for s in tqdm(starts, desc="eval", unit="win", disable=not progress, file=sys.stderr):
        y = ids[s + 1: s + ctx + 1]
        x = ids[s: s + len(y)]
        logits = model.logits(x[None])[0].float()
        y = y.to(logits.device)
        nll += F.cross_entropy(logits, y, reduction="sum").item()
        n += len(y)
        if baseline is not None:
            base = baseline.logits(x[None])[0].float().to(logits.device)
            lp_b, lp_m = base.log_softmax(-1), logits.log_softmax(-1)
            kl += (lp_b.exp() * (lp_b - lp_m)).sum(-1).sum().item()
            agree += (base.argmax(-1) == logits.argmax(-1)).sum().item()
    out = {"ppl": math.exp(nll / n), "nll": nll / n, "tokens": n, "windows": len(starts), "ctx": ctx}
    if baseline is not None:
        out.update(kl=kl / n, top1=agree / n)
    return out
