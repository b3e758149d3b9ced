"""Next-token sampling: greedy, temperature, top-k, top-p, seeded."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmaccel.errors import LlmaccelError


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    stop: list[str] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise LlmaccelError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LlmaccelError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LlmaccelError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0:
            raise LlmaccelError(f"max_tokens must be >= 0, got {self.max_tokens}")


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, on (B, V) logits (fp32)."""
    logits = logits.float() / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sp, idx = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = (sp.cumsum(-1) - sp) >= p.top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids."""
    if p.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filtered_probs(logits, p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
