"""Evaluation and calibration text: a file split by characters, or samples from a model."""
from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
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


DATA_DIR = Path(__file__).resolve().parents[1] / "data"   # package data (pyproject): the bundled texts

# name -> (file under llmaccel/data/, split): the evaluation text of each domain
DOMAINS: dict[str, tuple[str, str]] = {
    "wikitext2": ("wikitext2/wiki.test.raw", "second-half"),
    "python-code": ("python-code/stdlib.py.txt", "first-half"),
    "python-docs": ("python-docs/topics.txt", "first-half"),
}
# name -> split: the calibration part of each domain's file, disjoint from its evaluation part
CALIB_SPLITS: dict[str, str] = {"wikitext2": "first-half", "python-code": "second-half",
                                "python-docs": "second-half"}


def mixed_tokens(encode: Callable[[str], list[int]], max_tokens: int, ctx: int) -> torch.Tensor:
    """Calibration text of every domain: windows of `ctx` ids taken in turn from each domain's
    calibration part (CALIB_SPLITS) until there are max_tokens; a domain whose part runs out
    leaves the turn to the others. Quantized on wikitext2 alone, W4 loses twice as much on code
    and docs as on prose (docs/quality.md, "quant")."""
    parts = []
    for name, split in CALIB_SPLITS.items():
        ids = encode(read_split(str(DATA_DIR / DOMAINS[name][0]), split))
        parts.append([ids[s: s + ctx] for s in range(0, len(ids) - ctx + 1, ctx)])
    out: list[int] = []
    for i in range(max(map(len, parts))):
        for windows in parts:
            if i < len(windows) and len(out) < max_tokens:
                out += windows[i][: max_tokens - len(out)]
    if len(out) < 2:
        raise LlmaccelError(f"the bundled texts give fewer than one window of {ctx} tokens")
    return torch.tensor(out, dtype=torch.long)


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


def _step_seconds(model, rows: int, pos: int) -> float:
    """One decode step of `rows` sequences at position `pos`, timed, in a fresh cache advanced
    to `pos`: the keys before it are the cache's zeros (a step costs the same whatever they hold)."""
    cache = model.new_cache(rows, pos + 1)
    cache.advance(pos)
    tok = torch.zeros(rows, 1, dtype=torch.long, device=model.device)
    t0 = time.perf_counter()
    model.logits(tok, pos, cache)[0, 0, 0].item()  # .item(): waits for a GPU to finish
    return time.perf_counter() - t0


def step_costs(model, rows: int, seq_len: int) -> list[float] | None:
    """Predicted seconds of the decode step at each position 0 .. seq_len - 2 for `rows`
    sequences: steps timed at the first, middle and last position (after one untimed step that
    warms up), interpolated linearly between them. A step attends over every earlier position,
    so a late one costs several times an early one (SmolLM2-135M, 128 sequences, 2-core CPU:
    ~0.5 s at 0, ~3 s at 510). None where the model's cache cannot start mid-sequence (an ONNX
    session's, a quantized one's)."""
    last = seq_len - 2
    if last < 0:
        return None
    try:
        _step_seconds(model, rows, 0)
        probes = sorted({0, last // 2, last})
        times = [_step_seconds(model, rows, p) for p in probes]
    except Exception:  # noqa: BLE001 - the estimate is advice: without it the bar still runs
        return None
    return [float(np.interp(p, probes, times)) for p in range(last + 1)]


def _about(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"about {seconds:.0f} s"
    return f"about {seconds / 60:.0f} min" if seconds < 5400 else f"about {seconds / 3600:.1f} h"


class _SamplingBar(tqdm):
    """A bar over sampled tokens whose time left follows `costs` (step_costs: seconds of a
    full batch's step by position), scaled by how long the steps so far took against their
    predicted cost. tqdm's own estimate, the recent rate times the tokens left, would stay low
    until the end, since late steps cost more than early ones."""

    def __init__(self, costs: list[float] | None, batch: int, rows: int, **kw):
        if costs is not None:
            kw["bar_format"] = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{left}, {rate_fmt}]"
        self.costs, self.batch, self.step, self.rows_now = costs, batch, 0, batch
        self.done, self.left = 0.0, sum(costs or ()) * rows / batch
        super().__init__(**kw)

    def new_batch(self, rows: int) -> None:
        self.step, self.rows_now = 0, rows

    def update(self, n=1):
        if self.costs is not None and self.step < len(self.costs):
            cost = self.costs[self.step] * self.rows_now / self.batch
            self.done, self.left = self.done + cost, max(0.0, self.left - cost)
        self.step += 1
        return super().update(n)

    @property
    def format_dict(self):
        d = super().format_dict
        if self.costs is not None:
            d["left"] = self.format_interval(d["elapsed"] * self.left / self.done) if self.done else "?"
        return d


@torch.no_grad()
def sampled_tokens(model, n_tokens: int, *, seq_len: int = 512, seed: int = 0,
                   batch: int | None = None, progress: bool = False, purpose: str = "") -> torch.Tensor:
    """Seeded samples (temperature 1) from `model`, concatenated to n_tokens ids.

    Lets fidelity be measured, and passes be calibrated, with no data file at all. Rows are
    sampled `batch` at a time (default: as many as fit in 64k tokens of a batch, at most 256):
    one forward per token for the whole batch. With `progress`, a line on stderr first says how
    many tokens, what for (`purpose`, e.g. "for calibration") and about how long (step_costs);
    then a bar runs.
    """
    batch = batch or max(1, min(256, (1 << 16) // seq_len))
    gen = torch.Generator(device=model.device).manual_seed(seed)
    start = model.config.bos_token_id if model.config.bos_token_id is not None else 0
    out: list[torch.Tensor] = []
    total = 0
    rows = -(-n_tokens // seq_len)
    costs = None
    if progress:  # what and how much at once; how long once a few steps are timed (seconds)
        first = min(batch, rows)
        tqdm.write(f"sampling {n_tokens:,} tokens from {getattr(model, 'source', 'the model')} ({rows} sequences "
                   f"of {seq_len}, temperature 1){' ' + purpose if purpose else ''}", file=sys.stderr, end="")
        sys.stderr.flush()
        costs = step_costs(model, first, seq_len)
        tqdm.write("" if costs is None else f": {_about(sum(costs) * rows / first)} on this machine (a step of "
                   f"{first} sequences: {costs[0]:.2g} s at position 0, {costs[-1]:.2g} s at {seq_len - 2})",
                   file=sys.stderr)
    with _SamplingBar(costs, min(batch, rows), rows, total=rows * (seq_len - 1),
                      desc="sampling text from the model", unit="tok", disable=not progress,
                      file=sys.stderr) as bar:
        while total < n_tokens:
            B = min(batch, -(-(n_tokens - total) // seq_len))
            bar.new_batch(B)
            seqs = torch.full((B, 1), start, dtype=torch.long, device=model.device)
            out.extend(continue_samples(model, seqs, seq_len, gen, bar).cpu())
            total += B * seq_len
    return torch.cat(out)[:n_tokens]


def load_tokens(model, text: str, split: str, max_tokens: int | None, *, ctx: int = 512,
                seed: int = 0, progress: bool = False, purpose: str = "") -> torch.Tensor:
    """Token ids for `text` = a file path, 'self' (samples from `model`, with a progress bar on
    stderr when `progress`, after a line naming `purpose`: sampled_tokens) or 'mixed' (windows of
    `ctx` from the bundled texts' calibration parts: mixed_tokens)."""
    if max_tokens is not None and max_tokens < 2:
        raise LlmaccelError(f"max_tokens must be at least 2 (one token and its successor), got {max_tokens}")
    if text == "self":
        return sampled_tokens(model, max_tokens or 4 * ctx, seq_len=ctx, seed=seed, progress=progress,
                              purpose=purpose)
    if text == "mixed":  # the bundled texts' calibration parts, `split` aside
        return mixed_tokens(text_encoder(model), max_tokens or 4 * ctx, ctx)
    return file_tokens(model, text, split, max_tokens)
