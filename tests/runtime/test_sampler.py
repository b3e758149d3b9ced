"""sample_rows (the sampler of every decode path) against filtered_probs (the reference)."""
import pytest
import torch

from llmaccel.sampling import (SamplingParams, filtered_probs, round_uniforms, row_uniforms, sample_mode,
                                     sample_rows, sample_sorted)


def _rows(n, **kw):
    p = SamplingParams(**kw)
    f = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    return (f(float(p.temperature), torch.float32), f(p.top_k, torch.int64),
            f(float(p.top_p), torch.float32), sample_mode([p]), p)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, top_k=6, top_p=0.7)],
                         ids=["plain", "top-k", "top-p", "both"])
@pytest.mark.parametrize("how", ["sample_rows", "sample_sorted"])
def test_sampled_tokens_follow_the_filtered_distribution(kw, how):
    """20,000 rows of the same logits, each with its own seed: token counts against the
    reference probabilities (chi-square), and no token outside the filtered support; for the
    sampler of every path (the reference's algorithm) and the CUDA fallback (sample_sorted)."""
    V, n = 12, 20000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2
    t, k, p, mode, params = _rows(n, **kw)
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    pos = torch.full((n,), 5)
    if how == "sample_rows":
        toks = sample_rows(logits.expand(n, V), t, k, p, seeds, pos, mode)
    else:
        toks = sample_sorted(logits.expand(n, V), t, k, p, round_uniforms(seeds, pos, 1), mode)
    want = filtered_probs(logits[None], params)[0]
    counts = torch.bincount(toks, minlength=V).double()
    assert counts[want == 0].sum() == 0
    keep = want > 0
    e = want[keep].double() * n
    stat = ((counts[keep] - e) ** 2 / e).sum()
    df = int(keep.sum()) - 1
    assert float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2)) > 1e-3


def test_greedy_rows_and_sampled_rows_share_a_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    t = torch.tensor([0.0, 1.0, 0.0, 0.8, 0.0, 1.5])
    k = torch.tensor([0, 0, 3, 10, 0, 0])
    p = torch.tensor([1.0, 0.9, 1.0, 1.0, 0.5, 1.0])
    seeds, pos = torch.arange(6) + 100, torch.arange(6) + 20
    out = sample_rows(logits, t, k, p, seeds, pos, "filter")
    assert out[[0, 2, 4]].tolist() == logits[[0, 2, 4]].argmax(-1).tolist()
    # a row's draw depends on its own seed and position alone, not on the other rows
    alone = sample_rows(logits[3:4], t[3:4], k[3:4], p[3:4], seeds[3:4], pos[3:4], "filter")
    assert alone.item() == out[3].item()
    assert sample_rows(logits, t * 0, k, p, seeds, pos, "greedy").tolist() == logits.argmax(-1).tolist()


def test_row_uniforms_are_uniform_and_keyed_by_seed_and_position():
    seeds = torch.tensor([1, 1, 2, (1 << 61) + 1])
    pos = torch.tensor([0, 1, 0, 0])
    u = row_uniforms(seeds, pos)
    assert len(set(u.tolist())) == 4 and bool(((u > 0) & (u < 1)).all())
    many = row_uniforms(torch.full((100000,), 42), torch.arange(100000))
    hist = torch.histc(many, bins=10, min=0, max=1)
    assert float((hist - 10000).abs().max()) < 500  # 5 sigma of a binomial(1e5, 0.1) is ~475
