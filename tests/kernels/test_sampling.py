"""The sort-free sampling kernel against sample_reference (llmaccel/sampling.py).

Both run the same algorithm on the same uniforms, so they draw the same tokens; they may part
only where a uniform falls within a few ulps of a token's CDF boundary (another summation
order), hence at most one row in 50 (at least one allowed) not identical over fresh random logits, and every token inside its row's
filtered support. CPU: the kernel under TRITON_INTERPRET=1 at small vocabularies (one and
several blocks); CUDA (@cuda): Llama-1B's vocabulary in bf16 at 1 and 64 rows. That the
algorithm follows the filtered distribution is tested on the reference (tests/runtime/test_sampler.py).
"""
import pytest
import torch

from llmaccel.sampling import ROUNDS, filtered_probs, round_uniforms, sample_reference, SamplingParams

kern = pytest.importorskip("llmaccel.kernels.sampling")
if not kern.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)
INTERPRETED = type(kern._sample_kernel).__name__ == "InterpretedFunction"
cpu_kernels = pytest.mark.skipif(not INTERPRETED, reason="kernels were imported without TRITON_INTERPRET=1")


def _case(B, V, dtype, device, g):
    logits = (torch.randn(B, V, generator=g) * torch.rand(B, 1, generator=g) * 6).to(dtype).to(device)
    temp = torch.rand(B, generator=g) * 1.5 + 0.2
    temp[::5] = 0.0  # greedy rows in the batch
    top_k = torch.randint(0, V + 4, (B,), generator=g)
    top_k[::3] = 0
    top_p = torch.rand(B, generator=g) * 0.9 + 0.1
    top_p[::4] = 1.0
    seeds = torch.randint(0, 1 << 40, (B,), generator=g)
    pos = torch.randint(0, 4096, (B,), generator=g)
    return [a.to(device) for a in (logits, temp, top_k, top_p, seeds, pos)]


def _check(logits, temp, top_k, top_p, seeds, pos, chunk=None):
    got = kern.sample_triton(logits, temp, top_k, top_p, seeds, pos, ROUNDS, chunk=chunk).cpu()
    want = sample_reference(logits, temp, top_k, top_p, round_uniforms(seeds, pos, ROUNDS)).cpu()
    # a row may part where its uniform falls within rounding of a token's CDF boundary
    assert (got != want).sum() <= max(1, 0.02 * len(got))
    for i in range(logits.shape[0]):
        t = float(temp[i])
        if t == 0:
            assert got[i] == logits[i].argmax().cpu()
            continue
        p = SamplingParams(temperature=t, top_k=int(top_k[i]), top_p=float(top_p[i]))
        probs = filtered_probs(logits[i:i + 1].float().cpu(), p)[0]
        assert probs[got[i]] > 0, f"row {i}: token {got[i]} outside the filtered support"


@cpu_kernels
# one program a row: one block; three blocks with a partial one. Chunk kernels (then the row
# kernel for top-k rows and rejected draws): 5 chunks with a partial one; three of 2048.
@pytest.mark.parametrize("V,chunk", [(300, 0), (5000, 0), (300, 64), (5000, None)])
def test_kernel_draws_the_reference_tokens(V, chunk):
    g = torch.Generator().manual_seed(V + (chunk or 0))
    _check(*_case(12, V, torch.float32, "cpu", g), chunk=chunk)


@cpu_kernels
def test_chunk_kernels_rejected_draws_and_top_p_one():
    """Narrow nuclei (most round-0 draws rejected, the row kernel resumes from round 1) and
    top_p = 1 rows (accepted at once), through the chunk kernels, equal the reference."""
    g = torch.Generator().manual_seed(9)
    B, V = 16, 700
    logits = torch.randn(B, V, generator=g) * 3
    temp = torch.full((B,), 1.3)
    top_p = torch.where(torch.arange(B) % 2 == 0, torch.tensor(0.05), torch.tensor(1.0))
    zeros = torch.zeros(B, dtype=torch.int64)
    seeds, pos = torch.arange(B) * 7 + 1, torch.arange(B) + 100
    for rows in (slice(None), slice(0, 4)):  # three rounds in chunks; one (fewer than 8 rows)
        _check(*(a[rows] for a in (logits, temp, zeros, top_p, seeds, pos)), chunk=128)


@cpu_kernels
def test_top_k_keeps_every_tie_of_the_kth_value():
    """The radix select finds the k-th largest value, as the reference's bisection does: with
    logits on a few levels, the cut falls inside a run of equal values and keeps all of it."""
    g = torch.Generator().manual_seed(3)
    B, V = 6, 5000
    logits = torch.randint(0, 6, (B, V), generator=g).float() * 0.7
    top_k = torch.tensor([1, 7, 100, 1000, 2500, 4999])
    ones = torch.ones(B)
    seeds, pos = torch.arange(B) * 11 + 5, torch.arange(B)
    got = kern.sample_triton(logits, ones, top_k, ones, seeds, pos, ROUNDS)
    want = sample_reference(logits, ones, top_k, ones, round_uniforms(seeds, pos, ROUNDS))
    assert got.tolist() == want.tolist()
    for i in range(B):  # the drawn token is among the values at or above the k-th largest
        assert logits[i, got[i]] >= logits[i].topk(int(top_k[i])).values[-1]


@cpu_kernels
def test_no_zero_probability_token_where_rounding_leaves_the_target_unmet():
    """Each row's first chunk holds exactly u_0 of the mass and ends in a -inf logit: the
    chunk sums and the running sum inside the chunk round apart, the target may be unmet
    there, and the draw falls back to the last token that has mass (never token 63)."""
    B, V = 64, 128
    seeds, pos = torch.arange(B) * 977 + 3, torch.full((B,), 5)
    u = round_uniforms(seeds, pos, 1)[:, 0].double()
    lg = torch.randn(B, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.5
    lg[:, 63] = -float("inf")
    a, b = lg[:, :64].exp().sum(1), lg[:, 64:].exp().sum(1)
    lg[:, :64] += torch.log(u * b / (1 - u) / a)[:, None]
    ones, zeros = torch.ones(B), torch.zeros(B, dtype=torch.int64)
    for chunk in (0, 64):
        got = kern.sample_triton(lg.float(), ones, zeros, ones, seeds, pos, 1, chunk=chunk)
        assert not (got == 63).any()
    want = sample_reference(lg.float(), ones, zeros, ones, round_uniforms(seeds, pos, 1))
    assert not (want == 63).any()


@cpu_kernels
def test_kernel_hashes_the_uniforms_of_round_uniforms():
    """The kernel's in-kernel hash (int64 arithmetic in Triton) equals round_uniforms': with
    top_p = 1 and no top-k one round inverts the CDF at u[:, 0], so the token reveals u."""
    g = torch.Generator().manual_seed(5)
    V, B = 64, 16
    logits = torch.zeros(B, V)  # uniform rows: the token is floor(u * V)
    seeds = torch.randint(0, 1 << 62, (B,), generator=g)
    pos = torch.randint(0, 1 << 31, (B,), generator=g)
    u = round_uniforms(seeds, pos, 1)[:, 0]
    for chunk in (0, 16):  # one program a row; the chunk kernels
        got = kern.sample_triton(logits, torch.ones(B), torch.zeros(B, dtype=torch.int64), torch.ones(B),
                                 seeds, pos, 1, chunk=chunk)
        assert got.tolist() == (u * V).floor().long().tolist()


@pytest.mark.cuda
@pytest.mark.parametrize("B", [1, 64])
def test_kernel_on_the_gpu_at_a_real_vocabulary(B):
    g = torch.Generator().manual_seed(B)
    _check(*_case(B, 128256, torch.bfloat16, "cuda", g))


@cpu_kernels
def test_greedy_kernel_is_the_first_argmax():
    x = torch.randn(5, 4500)
    x[1, 10] = x[1, 3000] = 50.0  # a tie: the first index, as torch.argmax
    x[2] = 0.0
    x[3, 2048] = x[3, 4000] = 60.0  # a tie across chunks
    for chunk in (None, 0, 512):  # chunk kernels of 2048 and 512; one program a row
        assert kern.argmax_triton(x, chunk=chunk).tolist() == x.argmax(-1).tolist()


@cpu_kernels
def test_the_start_up_check_passes_at_a_chunked_vocabulary_in_bf16():
    from llmaccel.sampling import check_kernels
    assert check_kernels(torch.device("cpu"), 5000, torch.bfloat16) is None


@pytest.mark.cuda
def test_the_kernel_serves_this_gpu():
    from llmaccel.sampling import kernel_check
    assert kernel_check("cuda") is None
    assert kernel_check("cuda", 128256, torch.bfloat16) is None  # Llama's vocabulary, as LLM checks it
