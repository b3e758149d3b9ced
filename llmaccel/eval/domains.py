"""Quality on several domains: perplexity, and KL / top-1 against the source, on wikitext2's
second half and on texts of other domains (llmaccel/data/*/README.md give their sources and
licences).

No pass calibrates or trains on an evaluation part: the default calibration (`--calib mixed`,
text.mixed_tokens) reads the other parts, wikitext2's first half and the second halves of the code
and documentation texts. Models are plain forward callables `logits = f(ids)` (ids (B, T)), so a pass can
score graphs it holds (`graph_forward`) without a compiled model around them.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from llmaccel.errors import LlmaccelError
from llmaccel.eval.text import DATA_DIR, DOMAINS, read_split, text_encoder
from llmaccel.ir import positions

Forward = Callable[[torch.Tensor], torch.Tensor]


def ppl_of(mean_nll: float) -> float:
    """exp(mean NLL); inf where that overflows a float (a broken model's NLL of 700+ nats a
    token is a result to report, not an error)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def domain_tokens(encode: Callable[[str], list[int]], max_tokens: int, names=None) -> dict[str, torch.Tensor]:
    """{domain: the first max_tokens token ids of its evaluation text}, by `encode` (text_encoder)."""
    names = list(DOMAINS) if names is None else list(names)
    out = {}
    for name in names:
        if name not in DOMAINS:
            raise LlmaccelError(f"unknown domain {name!r}; known: {', '.join(DOMAINS)}")
        rel, split = DOMAINS[name]
        path = DATA_DIR / rel
        if not path.is_file():
            raise LlmaccelError(f"domain {name}: missing text {path}")
        ids = encode(read_split(str(path), split))[:max_tokens]
        if len(ids) < 2:
            raise LlmaccelError(f"domain {name}: fewer than 2 tokens")
        out[name] = torch.tensor(ids, dtype=torch.long)
    return out


def window_batches(ids: torch.Tensor, ctx: int, size: int):
    """(x, y) stacks of up to `size` consecutive non-overlapping windows of equal length:
    window s predicts ids[s+1 : s+ctx+1] from ids[s : s+ctx]."""
    group: list[tuple[torch.Tensor, torch.Tensor]] = []
    for s in range(0, len(ids) - 1, ctx):
        y = ids[s + 1: s + ctx + 1]
        if group and (len(group) == size or len(y) != len(group[0][1])):
            yield torch.stack([g[0] for g in group]), torch.stack([g[1] for g in group])
            group = []
        group.append((ids[s: s + len(y)], y))
    if group:
        yield torch.stack([g[0] for g in group]), torch.stack([g[1] for g in group])


def graph_forward(gm) -> Forward:
    """A whole-sequence forward (no cache) of an IR graph module."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return gm(x, positions(x), None)
    return f


@torch.no_grad()
def compare(source: Forward, models: dict[str, Forward], tokens: dict[str, torch.Tensor], *,
            ctx: int = 512, batch: int = 2, device="cpu") -> dict:
    """Per domain: the source's perplexity and, per model, ppl, ΔPPL (%), mean KL(source ‖ model)
    and top-1 agreement over the same predicted tokens. The source runs once per window."""
    out = {}
    for dom, ids in tokens.items():
        acc = {name: {"nll": 0.0, "kl": 0.0, "top1": 0} for name in models}
        src_nll, n = 0.0, 0
        for x, y in window_batches(ids, ctx, batch):
            x, y = x.to(device), y.flatten().to(device)
            base = source(x).float().flatten(0, 1)
            lp_b = base.log_softmax(-1)
            src_nll += F.nll_loss(lp_b, y, reduction="sum").item()
            n += len(y)
            for name, fwd in models.items():
                lp_m = fwd(x).float().flatten(0, 1).log_softmax(-1)
                a = acc[name]
                a["nll"] += F.nll_loss(lp_m, y, reduction="sum").item()
                a["kl"] += F.kl_div(lp_m, lp_b, log_target=True, reduction="sum").item()
                a["top1"] += (lp_b.argmax(-1) == lp_m.argmax(-1)).sum().item()
        src_ppl = ppl_of(src_nll / n)
        res: dict = {"tokens": n, "source_ppl": round(src_ppl, 4)}
        for name, a in acc.items():
            ppl = ppl_of(a["nll"] / n)
            res[name] = {"ppl": round(ppl, 4), "delta_ppl_pct": round(100 * (ppl / src_ppl - 1), 3),
                         "kl": round(a["kl"] / n, 5), "top1": round(a["top1"] / n, 4)}
        out[dom] = res
    return out


__all__ = ["DOMAINS", "ppl_of", "DATA_DIR", "text_encoder", "domain_tokens", "window_batches", "graph_forward", "compare"]
