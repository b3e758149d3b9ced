"""Speculative decoding: drafts that propose k tokens, and verification that keeps the target's
output distribution exactly (rejection sampling) and greedy output token for token.

Drafts:
  ModelDraft   a model with the same vocabulary (the target quantized, or a separate one) and its
               own paged cache, indexed by the same block tables; it catches up lazily on the
               tokens it has not seen (the prompt on the first round).
  NgramDraft   prompt lookup: the tokens that followed the latest earlier occurrence of the last n
               tokens (n = 3, 2, 1); q is one-hot.

A row without a proposal is a plain decode row (core.py), and every draft's proposals pause
after misses (eager_steps.EagerSteps._spec_stats).
"""
from __future__ import annotations

import torch

from llmaccel.compiler.model import load
from llmaccel.errors import LlmaccelError
from llmaccel.runtime.kv_cache import PagedKVCache, build_step
from llmaccel.sampling import filtered_probs

# speculative="self" picks this draft derived from the target (docs/runtime.md: measured
# acceptance x cost). "self:int8" / "self:int4": the target's weights quantized by the `quant`
# pass (RTN, no calibration), with its own KV cache.
SELF_DEFAULT = "int8"
QUANT_DRAFTS = {"int8": {"bits": 8, "method": "rtn"},
                "int4": {"bits": 4, "method": "rtn", "group_size": 128}}


def parse_self(spec: str) -> str:
    kind = spec.partition(":")[2] or SELF_DEFAULT
    if kind in QUANT_DRAFTS:
        return kind
    # self:N (the target's first N layers) was removed: it never paid (docs/runtime.md)
    raise LlmaccelError(f"unknown draft {spec!r}; the drafts are self (= self:int8), self:int4, "
                        f"ngram or a draft model with the target's vocabulary")


def draft_source(model, speculative: str | None, *, dtype, device):
    """(draft model, its name) for LLM's speculative= argument; (None, None) for no draft or
    ngram, which needs no model."""
    if speculative is None or speculative == "ngram":
        return None, None
    cfg = model.config
    if speculative.startswith("self"):
        kind = parse_self(speculative)
        from llmaccel.compiler.pipeline import compile

        d = compile(model.source, ["quant"], {"quant": dict(QUANT_DRAFTS[kind])},
                    eval_tokens=0, progress=False, dtype=dtype, device=device)
        return d, f"self:{kind}"
    d = load(speculative, dtype=dtype, device=device)
    if d.config.vocab_size != cfg.vocab_size:
        raise LlmaccelError(f"draft {speculative} has a vocabulary of {d.config.vocab_size}; "
                            f"the target's is {cfg.vocab_size}")
    return d, speculative


def verify(logits: torch.Tensor, proposal: list[int], draft_probs: torch.Tensor | None, params,
           generator, greedy_ids: list[int] | None = None) -> list[int]:
    """Tokens to append: the accepted prefix of `proposal` plus one token from the target.

    logits (k+1, V) are the target's at the positions before each proposed token and after the
    last. Greedy: accept while the proposal equals the target's argmax. Sampling: accept x_i with
    probability min(1, p(x_i) / q(x_i)); on the first rejection draw from norm(max(0, p - q));
    if all are accepted draw the bonus token from p. q is one-hot when draft_probs is None.
    """
    k = len(proposal)
    if params.temperature == 0:
        am = greedy_ids if greedy_ids is not None else logits.argmax(-1).tolist()
        a = 0
        while a < k and proposal[a] == am[a]:
            a += 1
        return proposal[:a] + [am[a]]
    p = filtered_probs(logits, params)
    for i, x in enumerate(proposal):
        qx = float(draft_probs[i, x]) if draft_probs is not None else 1.0
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * qx < float(p[i, x]):
            continue
        if draft_probs is not None:
            resid = (p[i] - draft_probs[i]).clamp_min(0)
        else:
            resid = p[i].clone()
            resid[x] = 0
        if float(resid.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
            resid = p[i]
        t = int(torch.multinomial(resid / resid.sum(), 1, generator=generator))
        return proposal[:i] + [t]
    return proposal + [int(torch.multinomial(p[k], 1, generator=generator))]


class NgramIndex:
    """The latest start of every n-gram (n_min..n_max) of a token list that has a token after it,
    kept up to date as the list grows (sequences only append): a lookup costs O(n_max) whatever
    the length, where a scan of a 4,000-token history took milliseconds of Python a step."""

    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min
        self.starts: dict[tuple, int] = {}
        self.upto = 0   # n-grams followed by toks[e] for every e < upto are in `starts`

    def update(self, toks: list[int]) -> None:
        for e in range(max(self.upto, 1), len(toks)):
            for n in range(self.n_min, min(self.n_max, e) + 1):
                self.starts[tuple(toks[e - n: e])] = e - n   # later starts overwrite earlier
        self.upto = len(toks)

    def lookup(self, toks: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix (n_max down to
        n_min) that occurred before; [] when none did."""
        L = len(toks)
        self.update(toks)   # the suffix itself has no token after it: it is not in `starts`
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            s = self.starts.get(tuple(toks[L - n:]))
            if s is not None:
                return toks[s + n: s + n + k]
        return []


class NgramDraft:
    """Prompt lookup over each sequence's NgramIndex (kept on the sequence); [] without a match."""
    name = "ngram"

    def __init__(self, n_max: int = 3, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, items: list[tuple[object, int]]) -> dict[int, tuple[list[int], None]]:
        for seq, _ in items:
            if seq.draft_state is None:
                seq.draft_state = NgramIndex(self.n_max, self.n_min)
        return {seq.id: (seq.draft_state.lookup(seq.token_ids, k), None) for seq, k in items}


class ModelDraft:
    def __init__(self, gm, cache: PagedKVCache, *, device, name: str = "model"):
        self.gm, self.cache, self.device, self.name = gm, cache, device, name

    def _start(self, seq) -> int:
        """The first position to feed: at most the last token's (a verification that failed
        after this draft proposed leaves draft_computed past the tokens; the rejected
        proposals' KV there is overwritten as the sequence goes on)."""
        return min(seq.draft_computed, len(seq.token_ids) - 1)

    @torch.no_grad()
    def propose(self, items: list[tuple[object, int]]) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """items: (sequence, k) with k >= 1 and exactly one token of the sequence not yet fed."""
        out = {seq.id: ([], []) for seq, _ in items}
        start = {seq.id: self._start(seq) for seq, _ in items}
        feed = {seq.id: seq.token_ids[start[seq.id]:] for seq, _ in items}
        for j in range(max(k for _, k in items)):
            live = sorted([(s, k) for s, k in items if k > j], key=lambda sk: len(feed[sk[0].id]) != 1)
            step = [(s.block_table, start[s.id], feed[s.id]) for s, _ in live]
            ids, pos, ctx = build_step(self.cache, step, [1] * len(step), self.device)
            logits = self.gm(ids, pos, ctx)[0]
            if not getattr(self.gm, "selects_rows", False):
                logits = logits.index_select(0, ctx.logits_indices)
            greedy = logits.argmax(-1).tolist()
            for r, (s, _) in enumerate(live):
                if s.params.temperature == 0:
                    t = greedy[r]
                else:
                    q = filtered_probs(logits[r: r + 1], s.params)[0]
                    t = int(torch.multinomial(q, 1, generator=s.generator))
                    out[s.id][1].append(q)
                out[s.id][0].append(t)
                start[s.id] += len(feed[s.id])
                feed[s.id] = [t]
        for seq, _ in items:
            seq.draft_computed = start[seq.id]
        return {i: (toks, torch.stack(qs) if qs else None) for i, (toks, qs) in out.items()}
