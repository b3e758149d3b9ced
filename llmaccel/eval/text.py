"""Evaluation and calibration text: a file split by characters, or samples from a model."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from llmaccel.errors import LlmaccelError

SPLITS = ("first-half", "second-half", "all")


def read_split(path: str, split: str) -> str:
    """The file's text, read without newline translation, cut in half by characters."""
    if split not in SPLITS:
        raise LlmaccelError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    p = Path(path)
    if not p.is_file():
        raise LlmaccelError(f"no such text file: {path}")
    with open(p, encoding="utf-8", newline="") as f:
        text = f.read()
    half = len(text) // 2
    return {"first-half": text[:half], "second-half": text[half:], "all": text}[split]


def text_encoder(model) -> Callable[[str], list[int]]:
    """text -> token ids for `model`: its tokenizer; for a model without one (a preset) whose
    vocabulary has at least 256 ids, the text's UTF-8 bytes, one id per byte, so that a preset
    still sees text of distinct kinds."""
    if getattr(model, "tokenizer_dir", None) is not None:
        tok = model.tokenizer
        return lambda text: tok(text).input_ids
    if model.config.vocab_size >= 256:
        if not str(model.source).startswith("preset:"):  # a real model read as bytes: say so
            warnings.warn(f"{model.source} has no tokenizer: text is read as UTF-8 bytes, one id per byte")
        return lambda text: list(text.encode("utf-8"))
    raise LlmaccelError(f"{model.source} has no tokenizer and fewer than 256 token ids: "
                        "no text can be encoded for it")


def file_tokens(model, path: str, split: str, max_tokens: int | None) -> torch.Tensor:
    """The ids of a text file's split: by the model's tokenizer, or, for a model without one
    (a preset), its UTF-8 bytes (text_encoder), so that presets calibrate and evaluate on it."""
    text = read_split(path, split)
    ids = text_encoder(model)(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise LlmaccelError(f"{path} ({split}) gives fewer than 2 tokens")
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def continue_samples(model, prompts: torch.Tensor, length: int, gen: torch.Generator,
                     bar=None) -> torch.Tensor:
    """(B, length) ids: each prompt row (B, P) continued by temperature-1 samples from `model`;
    `bar` (a tqdm) advances by B per sampled position."""
    B, P = prompts.shape
    cache = model.new_cache(B, length)
    seqs = prompts.to(model.device)
    tok = seqs
    for _ in range(length - P):
        logits = model.logits(tok, cache.length, cache)[:, -1]
        tok = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen)
        seqs = torch.cat([seqs, tok], dim=1)
        if bar is not None:
            bar.update(B)
    return seqs


@torch.no_grad()
def sampled_tokens(model, n_tokens: int, *, seq_len: int = 512, seed: int = 0,
                   batch: int | None = None, progress: bool = False) -> torch.Tensor:
    """Seeded samples (temperature 1) from `model`, concatenated to n_tokens ids.

    Lets fidelity be measured, and passes be calibrated, with no data file at all. Rows are
    sampled `batch` at a time (default: as many as fit in 64k tokens of a batch, at most 256):
    one forward per token for the whole batch.
    """
    batch = batch or max(1, min(256, (1 << 16) // seq_len))
    gen = torch.Generator(device=model.device).manual_seed(seed)
    start = model.config.bos_token_id if model.config.bos_token_id is not None else 0
    out: list[torch.Tensor] = []
    total = 0
    rows = -(-n_tokens // seq_len)
    with tqdm(total=rows * (seq_len - 1), desc="sampling text from the model", unit="tok",
              disable=not progress, file=sys.stderr) as bar:
        while total < n_tokens:
            B = min(batch, -(-(n_tokens - total) // seq_len))
            seqs = torch.full((B, 1), start, dtype=torch.long, device=model.device)
            out.extend(continue_samples(model, seqs, seq_len, gen, bar).cpu())
            total += B * seq_len
    return torch.cat(out)[:n_tokens]


def load_tokens(model, text: str, split: str, max_tokens: int | None, *, ctx: int = 512,
                seed: int = 0, progress: bool = False) -> torch.Tensor:
    """Token ids for `text` = a file path or 'self' (samples from `model`, with a progress
    bar on stderr when `progress`)."""
    if max_tokens is not None and max_tokens < 2:
        raise LlmaccelError(f"max_tokens must be at least 2 (one token and its successor), got {max_tokens}")
    if text == "self":
        return sampled_tokens(model, max_tokens or 4 * ctx, seq_len=ctx, seed=seed, progress=progress)
    return file_tokens(model, text, split, max_tokens)
