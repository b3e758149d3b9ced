"""Text continued by the source model, for passes that fit or train on the model's own samples:
prompts (openings of calibration windows and of other kinds of text, eval/prompts.py) and the
call into the engine's sampler, which the frontends hand down as `PassContext.sampler` (the
engine sits above the passes).
"""
from __future__ import annotations

import math

import torch

from llmaccel.errors import LlmaccelError
from llmaccel.eval.domains import text_encoder
from llmaccel.eval.prompts import PROMPTS

PROMPT_TOKENS = 32  # tokens of a calibration window (at most) that start a sampled window


def sample_source(ctx, calib: torch.Tensor, n: int, length: int, kind: str, *, prompt_len: int,
                  seed: int, max_seqs: int, who: str, calib_share: float,
                  temperature: float = 1.0, top_p: float = 1.0) -> tuple[torch.Tensor, dict]:
    """n windows of `length` tokens continued by the source model from prompt_ids' prompts, with
    the engine's sampler (PassContext.sampler): (windows, the sampler's stats). who: the option
    that asked, named in the error when the sampler or the source model is missing."""
    if ctx.sampler is None or ctx.source_model is None:
        raise LlmaccelError(f"{who} needs the engine's sampler and the source model to generate "
                            f"windows with (llmc compile and llmaccel.compile hand them over; "
                            f"PassContext.sampler)")
    prompts = prompt_ids(ctx.source_model, calib, n, kind, prompt_len, calib_share)
    return ctx.sampler(ctx.source_model, prompts, length, seed=seed, max_seqs=max_seqs,
                       temperature=temperature, top_p=top_p)


def prompt_ids(model, calib: torch.Tensor, n: int, kind: str, prompt_len: int,
               calib_share: float) -> list[list[int]]:
    """n prompts of at most prompt_len tokens. calib: the openings of calibration windows (rows
    of `calib`, cycled). mixed: a `calib_share` of them (evenly spread; 0.5 = every other one)
    and, for the rest, the built-in openings of other kinds of text (cycled), encoded by
    text_encoder (a model without a tokenizer: bytes)."""
    if kind not in ("calib", "mixed"):
        raise LlmaccelError(f"heal.prompts must be auto, calib or mixed, got {kind!r}")
    rows = [r[:prompt_len].tolist() for r in calib]
    if not rows:
        raise LlmaccelError("heal: no calibration windows to take prompts from")
    builtin: list[list[int]] = []
    if kind == "mixed":
        encode = text_encoder(model)
        builtin = [ids[:prompt_len] for ids in map(encode, PROMPTS) if ids]
    other = 1.0 - calib_share if builtin else 0.0
    out: list[list[int]] = []
    taken = 0   # built-in openings so far: prompt i is one where floor((i + 1) * other) grows
    for i in range(n):
        if math.floor((i + 1) * other) > taken:
            out.append(builtin[taken % len(builtin)])
            taken += 1
        else:
            out.append(rows[(i - taken) % len(rows)])
    return out
