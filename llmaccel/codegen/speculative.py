"""Greedy speculative decoding on the static decode path (batch 1).

A round: the draft proposes k tokens, the target runs one forward over the last accepted token
and the k proposals (k + 1 positions), and the longest prefix of proposals equal to the target's
argmax is kept, plus the target's own next token. Output is therefore the target's greedy text.

Drafts:
  self:N  the target's first N layers with its final norm and LM head (LayerSkip style). Its
          layers compute the same K/V as the target's first N, so it writes into the target's
          static cache; the verify forward rewrites those positions with the target's values.
          The k draft steps and the verify step are CUDA graphs that read and write device
          buffers (last token, position, all tokens), so a round needs no host sync; the host
          syncs only to learn how many tokens were produced, once per batch of rounds.
  ngram   prompt lookup on the host (the tokens that followed the latest earlier occurrence of
          the last n tokens): one host sync per round.
Rejected positions need no rollback: the static cache masks every slot past the query's
position, and the next round overwrites them.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from llmaccel.codegen.engine import DecodeEngine, StepState, greedy
from llmaccel.errors import LlmaccelError
from llmaccel.runtime.speculative import NgramDraft


class SpecCounters(nn.Module):
    """Device-side counters: rounds run and proposals accepted."""

    def __init__(self, device):
        super().__init__()
        for name in ("rounds", "accepted"):
            buf = torch.zeros(1, dtype=torch.long, device=device)
            self.register_buffer(name, buf, persistent=False)
            torch._dynamo.mark_static_address(buf)


def parse_draft(spec: str, n_layers: int) -> str | int:
    if spec == "ngram":
        return "ngram"
    kind = spec.partition(":")[2] if spec.startswith("self") else None
    if kind is not None and kind.isdigit() and 1 <= int(kind) < n_layers:
        return int(kind)
    raise LlmaccelError(f"unknown speculative draft {spec!r} for the static decode path; use "
                        f"ngram or self:N with N in 1..{n_layers - 1} (the target's first N layers)")


class SpeculativeDecoder:
    """Greedy speculative generation for a DecodeEngine `target` (batch 1).

    draft: "ngram", or a DecodeEngine over the target's first layers built on the target's cache.
    """

    def __init__(self, target: DecodeEngine, draft: "DecodeEngine | str", k: int = 4):
        if target.batch != 1:
            raise LlmaccelError("speculative decoding on the static path runs at batch 1")
        if k < 1:
            raise LlmaccelError(f"the number of speculative tokens must be positive, got {k}")
        if target.cache.specs:  # its verify writes k + 1 tokens past the prefill, and rolls back
            raise LlmaccelError("speculative decoding on the static path needs a full-precision KV "
                                "cache (the graph has a KIVI-quantized one: use the runtime)")
        if isinstance(draft, DecodeEngine) and draft.cache is not target.cache:
            raise LlmaccelError("a self draft must share the target's static cache")
        self.target, self.draft, self.k = target, draft, k
        dev = torch.device(target.model.device)
        self.max_len = target.max_len
        self.state = StepState(1, self.max_len, dev)    # accepted tokens; pos = last one's position
        self.dstate = StepState(1, self.max_len, dev)   # the draft's running token and position
        self.dstate.out = self.state.out                # proposals land where verify reads them
        self.counters = SpecCounters(dev)
        self.offsets = torch.arange(k + 1, device=dev)
        torch._dynamo.mark_static_address(self.offsets)
        verify = self._verify_fn()
        dstep = self._draft_fn() if isinstance(draft, DecodeEngine) else None
        if target.compiled:
            verify = torch.compile(verify, **target.compile_opts)
            if dstep is not None:
                dstep = torch.compile(dstep, **draft.compile_opts)
        self._verify, self._dstep = verify, dstep
        self._ngram = NgramDraft() if draft == "ngram" else None

    def _verify_fn(self):
        st, d, c, k = self.state, self.dstate, self.counters, self.k
        gm, cache, attn = self.target.full_gm, self.target.cache, self.target.attn

        def verify() -> None:
            idx = st.pos + self.offsets                        # positions pos .. pos + k
            ids = st.out.index_select(1, idx)                  # last accepted token + k proposals
            logits = gm(ids, idx[None, :], cache.bind(idx, attn))
            am = logits.argmax(-1)                             # (1, k + 1) target's greedy tokens
            match = (am[:, :k] == ids[:, 1:]).long()
            a = match.cumprod(-1).sum(-1)                      # (1,) proposals accepted
            nxt = am.gather(1, a.view(1, 1))                   # the target's token after them
            st.out.index_copy_(1, st.pos + a + 1, nxt)
            st.pos.add_(a + 1)
            st.tok.copy_(nxt)
            d.tok.copy_(nxt)
            d.pos.copy_(st.pos)
            c.accepted.add_(a)
            c.rounds.add_(1)
        return verify

    def _draft_fn(self):
        d = self.dstate
        gm, cache, attn = self.draft.decode_gm, self.draft.cache, self.draft.attn

        def draft_step() -> None:
            pos = d.pos
            logits = gm(d.tok, pos[None, :], cache.bind(pos, attn))
            nxt = greedy(logits[:, -1])
            d.out.index_copy_(1, pos + 1, nxt)
            d.tok.copy_(nxt)
            d.pos.add_(1)
        return draft_step

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """n greedy tokens (1, n) after the prompt ids (1, P); equal to the target's plain greedy."""
        ids = ids.to(self.target.model.device)
        P = ids.shape[1]
        if ids.shape[0] != 1:
            raise LlmaccelError(f"expected ids of shape (1, T), got {tuple(ids.shape)}")
        if P + n + self.k + 1 > self.max_len:
            raise LlmaccelError(f"prompt {P} + {n} tokens + {self.k + 1} speculative slots exceed "
                                f"the cache's {self.max_len}")
        if n <= 0:
            return ids.new_zeros(1, 0)
        tok = self.target.prefill(ids)
        st, d = self.state, self.dstate
        st.out[:, :P].copy_(ids)
        st.out[:, P:P + 1].copy_(tok)
        for s in (st, d):
            s.tok.copy_(tok)
            s.pos.fill_(P)
        self.counters.rounds.zero_()
        self.counters.accepted.zero_()
        done = 1
        if self._ngram is not None:
            toks = ids[0].tolist() + tok[0].tolist()
            while done < n:
                prop = self._ngram.lookup(toks, self.k)
                prop = (prop + [toks[-1]] * self.k)[: self.k]  # padding is simply rejected
                pos = P + done - 1
                st.out[0, pos + 1: pos + 1 + self.k].copy_(torch.tensor(prop), non_blocking=True)
                self._verify()
                new = int(st.pos.item()) - P + 1
                toks += st.out[0, P + done: P + new].tolist()
                done = new
        else:
            while done < n:
                # every round yields at most k + 1 tokens: this many rounds cannot overshoot n
                for _ in range(math.ceil((n - done) / (self.k + 1))):
                    for _ in range(self.k):
                        self._dstep()
                    self._verify()
                done = int(st.pos.item()) - P + 1
        return st.out[:, P:P + n].clone()

    def stats(self) -> dict:
        rounds = int(self.counters.rounds.item())
        acc = int(self.counters.accepted.item())
        return {"spec_rounds": rounds, "spec_k": self.k,
                "spec_accept_rate": acc / (rounds * self.k) if rounds else None,
                "spec_tokens_per_round": (acc + rounds) / rounds if rounds else None}
