"""Next-token sampling: greedy, temperature, top-k, top-p, seeded."""
from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass

import torch

from llmaccel.errors import LlmaccelError


MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    stop: list[str] | None = None
    ignore_eos: bool = False
    # None: no logprobs; N >= 0: the sampled token's log-probability (under the model's
    # distribution, before temperature and filters) and the N most likely tokens' (N <= 20)
    logprobs: int | None = None

    def __post_init__(self):
        for name, kinds in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", int),
                            ("max_tokens", int), ("seed", (int, type(None))), ("ignore_eos", bool),
                            ("logprobs", (int, type(None)))):
            v = getattr(self, name)
            if not isinstance(v, kinds) or (isinstance(v, bool) and name != "ignore_eos"):
                raise LlmaccelError(f"{name} must be {'a bool' if name == 'ignore_eos' else 'a number'}"
                                    f"{' or None' if name in ('seed', 'logprobs') else ''}, got {v!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, list) or
                                      not all(isinstance(x, str) and x for x in self.stop)):
            raise LlmaccelError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not self.temperature >= 0:  # NaN too
            raise LlmaccelError(f"temperature must be >= 0, got {self.temperature}")
        if math.isinf(self.temperature):  # logits / inf are 0, or NaN where a filter put -inf
            raise LlmaccelError(f"temperature must be finite, got {self.temperature}")
        if not 0 <= self.top_k < 1 << 31:  # the sampler holds it in an int64 tensor, kernels in int32
            raise LlmaccelError(f"top_k must be in 0..{(1 << 31) - 1}, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LlmaccelError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0:
            raise LlmaccelError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise LlmaccelError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")


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


SEED_BITS = 62
_M32 = 0xFFFFFFFF


def request_seed(p: SamplingParams) -> int:
    """The seed of a request's draws: its own, or a fresh random one (not reproducible)."""
    return p.seed % (1 << SEED_BITS) if p.seed is not None else secrets.randbits(SEED_BITS)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 values in [0, 2^32): the
    constant is below 2^27, so no product overflows int64."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def row_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, a function of (seed, position) alone: a seeded request
    draws the same numbers whatever else shares its batch, whichever path (CUDA graph, eager
    step, reference executor) computes its step, and without generator state to carry."""
    return _to_uniform(_row_hash(seeds, positions))


def _row_hash(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    h = _mix32(seeds & _M32)
    h = _mix32(h ^ ((seeds >> 32) & _M32))
    return _mix32(h ^ (positions & _M32))


def _to_uniform(h: torch.Tensor) -> torch.Tensor:
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def round_uniforms(seeds: torch.Tensor, positions: torch.Tensor, rounds: int) -> torch.Tensor:
    """(B, rounds) uniforms of the sampler's rejection rounds; round 0 is row_uniforms."""
    h = _row_hash(seeds, positions)[:, None]
    r = torch.arange(1, rounds, device=h.device, dtype=torch.int64)
    later = _mix32(h ^ ((r * 0x9E3779B9) & _M32)[None, :])
    return _to_uniform(torch.cat([h, later], 1))


# Rejection rounds of a filtered draw: each lands in the nucleus with probability >= top_p, so
# a row still rejected after 32 (and then given its argmax) is out of reach of any real top_p.
ROUNDS = 32


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                mode: str = "filter") -> torch.Tensor:
    """Next tokens (B,) of logits (B, V), each row with its own parameters, on the logits'
    device and without a host sync on CUDA (a CUDA graph captures it).

    temperature, top_p: float32 (B,); top_k, seeds, positions: int64 (B,), positions being the
    index of the token drawn. A row of temperature 0 takes the argmax; the others draw from
    their filtered distribution (temperature, then top-k, then top-p) with the uniforms
    round_uniforms(seed, position): no sort (sample_reference). mode: "greedy" (every row
    greedy), "sample" (no row with top-k or top-p) or "filter" (the general case). On CUDA the
    Triton kernel (kernels/sampling.py) runs the reference's algorithm; where it does not pass
    kernel_check, sample_sorted.
    """
    kern = _kernels(logits)
    if mode == "greedy":
        return logits.argmax(-1) if kern is None else kern.argmax_triton(logits)
    if mode not in ("sample", "filter"):
        raise ValueError(f"mode must be greedy, sample or filter, got {mode!r}")
    # "sample": no sampled row has a filter (sample_mode), so one round is never rejected
    rounds = 1 if mode == "sample" else ROUNDS
    if kern is not None:  # the kernel hashes the uniforms itself: no tensor ops before it
        return kern.sample_triton(logits, temperature, top_k, top_p, seeds, positions, rounds)
    u = round_uniforms(seeds, positions, rounds)
    if logits.is_cuda:
        return sample_sorted(logits, temperature, top_k, top_p, u, mode)
    return sample_reference(logits, temperature, top_k, top_p, u)


def _kernels(logits: torch.Tensor):
    """The sampling kernel module for CUDA logits whose device passed kernel_check, else None."""
    if not logits.is_cuda:
        return None
    return None if kernel_check(logits.device, logits.shape[-1], logits.dtype) else _sampling_module()


def _sampling_module():
    from llmaccel.kernels import sampling
    return sampling


def kernel_check(device, vocab: int = 5000, dtype: torch.dtype = torch.float32) -> str | None:
    """Why the sampling kernels do not serve logits of this width and dtype on this CUDA device
    (None: they do). Checked once per (device, vocab, dtype) against the reference on 8 rows in
    every mode a step draws in, so the variants a step launches compile here (LLM checks its
    model's at start-up, outside any CUDA graph capture). Where it fails, CUDA rows are drawn
    by sample_sorted."""
    from llmaccel.kernels import device_index
    return check_kernels(torch.device("cuda", device_index(torch.device(device))), vocab, dtype)


@functools.cache
def check_kernels(dev: torch.device, vocab: int, dtype: torch.dtype) -> str | None:
    """kernel_check's test on any device (the CPU runs the kernels under TRITON_INTERPRET=1)."""
    kern = _sampling_module()
    if not kern.HAS_TRITON:
        return "triton is not installed"
    g = torch.Generator().manual_seed(0)
    B = 8  # at least CHUNK_ROUNDS_FROM rows: every round of the chunk kernels runs
    x = (torch.randn(B, vocab, generator=g) * 3).to(dtype).to(dev)
    t, k, p = (torch.tensor(v * (B // 4), device=dev) for v in
               ([0.0, 0.8, 1.0, 0.7], [0, 0, 20, 0], [1.0, 0.9, 1.0, 0.5]))
    seeds, pos = torch.arange(B, device=dev) + (7 << 33), torch.arange(B, device=dev)
    u = round_uniforms(seeds, pos, ROUNDS)
    no_k, no_p = torch.zeros_like(k), torch.ones_like(p)
    try:  # greedy, sampled without filters ("sample": one round), filtered
        parted = [(kern.sample_triton(x, t, no_k, no_p, seeds, pos, 1) !=
                   sample_reference(x, t, no_k, no_p, u[:, :1])).sum().item(),
                  (kern.sample_triton(x, t, k, p, seeds, pos, ROUNDS) !=
                   sample_reference(x, t, k, p, u)).sum().item()]
        greedy = torch.equal(kern.argmax_triton(x), x.argmax(-1))
    except Exception as e:  # noqa: BLE001 - any compile or launch failure: the torch path serves
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    # a row may part where its uniform falls within rounding of a token boundary: one of 8
    return None if greedy and max(parted) <= 1 else "its tokens differ from the reference's"


def sample_sorted(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, u: torch.Tensor, mode: str) -> torch.Tensor:
    """The CUDA path without the kernel, in graph-capturable torch ops: the rows sorted once,
    the CDF inverted in that order at the first uniform. Same distribution as the kernel's,
    other tokens for the same uniforms; ~1.4 ms for (64, 128k) logits on an H200."""
    greedy = logits.argmax(-1)
    V = logits.shape[-1]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = logits.float() / t[:, None]
    order = None
    if mode == "filter":  # top-k on the tempered logits, softmax, top-p on the sorted rows
        x, order = x.sort(-1, descending=True)
        rank = torch.arange(V, device=x.device)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
        x = x.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
        probs = torch.softmax(x, -1)
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p[:, None], 0.0)
    else:
        probs = torch.softmax(x, -1)
    cdf = probs.cumsum(-1)
    idx = (cdf < u[:, :1] * cdf[:, -1:]).sum(-1).clamp_max(V - 1)
    tok = idx if order is None else order.gather(1, idx[:, None])[:, 0]
    return torch.where(temperature > 0, tok, greedy)


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The sort-free sampler in torch ops (host syncs between rounds): see kernels/sampling.py
    for the algorithm. u: (B, R) uniforms, one per rejection round."""
    B, V = logits.shape
    greedy = logits.argmax(-1)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = logits.float() / t[:, None]
    e = torch.exp(x - x.max(-1, keepdim=True).values)
    key = e.view(torch.int32)
    thr = torch.zeros(B, dtype=torch.int32, device=e.device)
    cut = (top_k > 0) & (top_k < V)
    if bool(cut.any()):  # the bits of the k-th largest e, by bisection
        lo, hi = torch.zeros_like(thr), torch.full_like(thr, 0x3F800001)
        while bool((hi - lo > 1).any()):
            mid = (lo + hi) // 2
            ok = (key >= mid[:, None]).sum(-1) >= top_k
            lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
        thr = torch.where(cut, lo, thr)
    intop = key >= thr[:, None]
    zk = torch.where(intop, e, 0.0).sum(-1)
    low = torch.full((B,), -1.0, device=e.device)
    mass, tok, done = zk, greedy.clone(), temperature <= 0
    cols = torch.arange(V, device=e.device)
    for r in range(u.shape[1]):
        if bool(done.all()):
            break
        sup = intop & (e > low[:, None])
        w = torch.where(sup, e, 0.0)
        hit = (w.cumsum(-1) >= (u[:, r] * mass)[:, None]) & sup
        # when rounding leaves the target unmet: the last token that can be drawn (e > 0)
        last = torch.where(sup & (e > 0), cols, -1).max(-1).values
        j = torch.where(hit.any(-1), hit.int().argmax(-1), last)
        ej = e.gather(1, j.clamp_min(0)[:, None])[:, 0]  # rows done earlier may have none left
        above = torch.where(intop & (e > ej[:, None]), e, 0.0).sum(-1)
        ok = (top_p >= 1.0) | (above < top_p * zk)
        tok = torch.where(~done & ok, j, tok)
        low = torch.where(done, low, ej)
        mass = torch.where(done, mass, above)
        done = done | ok
    return tok


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int):
    """(log p of tokens (B,), top (B, top) ids and log-probabilities or None) under the
    logits' own distribution (B, V), fp32."""
    ls = torch.log_softmax(logits.float(), -1)
    lp = ls.gather(1, tokens[:, None])[:, 0]
    if top <= 0:
        return lp, None
    vals, ids = ls.topk(top, -1)
    return lp, (ids, vals)


def logprob_pairs(lp: list[float], ids: list[list[int]] | None = None,
                  vals: list[list[float]] | None = None) -> list[tuple[float, list]]:
    """Per token (logprob, [(id, logprob)] of the top tokens), from host lists."""
    if ids is None:
        return [(v, []) for v in lp]
    return [(v, list(zip(i, t))) for v, i, t in zip(lp, ids, vals)]


def logprobs_wanted(params: list[SamplingParams]) -> int:
    """-1 when no row asks for logprobs, else the most top tokens any row asks for."""
    return max((p.logprobs for p in params if p.logprobs is not None), default=-1)


def sample_mode(params: list[SamplingParams]) -> str:
    """The cheapest sample_rows mode that serves every row."""
    if all(p.temperature == 0 for p in params):
        return "greedy"
    if all(p.temperature == 0 or (p.top_k == 0 and p.top_p >= 1.0) for p in params):
        return "sample"
    return "filter"


def sample(logits: torch.Tensor, p: SamplingParams, seed: int, position: int) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids, every row with params p, the seed and the position of
    the drawn token (the reference executor's sampler: sample_rows on one parameter set)."""
    B, dev = logits.shape[0], logits.device
    return sample_rows(logits, torch.full((B,), float(p.temperature), device=dev),
                       torch.full((B,), p.top_k, dtype=torch.int64, device=dev),
                       torch.full((B,), float(p.top_p), device=dev),
                       torch.full((B,), seed, dtype=torch.int64, device=dev),
                       torch.full((B,), position, dtype=torch.int64, device=dev), sample_mode([p]))
