"""GPTQ's one-launch block kernel against the reference loop, and gptq with it.

CPU: the kernel under TRITON_INTERPRET=1 (IEEE, no fused multiply-adds, as the compiled kernel
is asked to be) on blocks of 128 and of a ragged width, int4 and int8 grids: codes equal and
errors within fp32 rounding (aten's addr_ may fuse its multiply-add where the kernel does not,
so a code on an exact rounding tie may go either way: at most one in a thousand). GPU (@cuda):
SmolLM2's gate_up shape through gptq with act_order, kernel against the reference on the GPU.
"""
import pytest
import torch

from llmaccel.quant.algorithms import Grid, gptq, gptq_block_ref

kern = pytest.importorskip("llmaccel.kernels.gptq")
if kern.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)
INTERPRETED = type(kern._gptq_block_kernel).__name__ == "InterpretedFunction"
cpu_kernels = pytest.mark.skipif(not INTERPRETED, reason="kernels were imported without TRITON_INTERPRET=1")


def _block(N, K, b, bits, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(4 * K, K, generator=g) * torch.rand(K, generator=g) * 3
    H = X.T @ X
    H += 0.01 * H.diagonal().mean() * torch.eye(K)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    W = torch.randn(N, K, generator=g)
    grid = Grid(bits, 32 if bits == 4 else K)
    s, z = grid.params(W)
    cols = torch.randperm(K, generator=g)[:b]  # any column order (act_order permutes)
    gidx = cols // grid.gs
    args = (W[:, cols], Hinv[:b, :b], s[:, gidx], z[:, gidx])
    return [a.to(device) for a in args], grid


def _agree(q_k, q_r, e_k, e_r):
    same = q_k == q_r
    assert same.float().mean() >= 0.999, f"{int((~same).sum())} of {same.numel()} codes differ"
    rows = same.all(1)  # a flipped code changes the rest of its row
    torch.testing.assert_close(e_k[rows], e_r[rows], rtol=1e-5, atol=1e-5)


@cpu_kernels
@pytest.mark.parametrize("N,b,bits", [(37, 128, 4), (20, 45, 4), (16, 64, 8)])
def test_block_kernel_matches_reference(N, b, bits):
    (W1, Hi, S, Z), grid = _block(N, 2 * b, b, bits)
    W_before = W1.clone()
    q_r, e_r = gptq_block_ref(W1, Hi, S, Z, grid.qmin, grid.qmax)
    assert torch.equal(W1, W_before)  # the reference leaves its input alone
    q_k, e_k = kern.gptq_block_triton(W1, Hi, S, Z, grid.qmin, grid.qmax)
    assert q_k.min() >= grid.qmin and q_k.max() <= grid.qmax and torch.equal(q_k, q_k.round())
    _agree(q_k, q_r, e_k, e_r)


def test_block_reference_is_gptq_column_by_column():
    """The reference's nine ops a column compute what GPTQ's textbook loop does."""
    (W1, Hi, S, Z), grid = _block(9, 40, 40, 4)
    W = W1.clone()
    Q, E = torch.zeros_like(W), torch.zeros_like(W)
    for i in range(W.shape[1]):
        q = ((W[:, i] / S[:, i]).round() + Z[:, i]).clamp(grid.qmin, grid.qmax)
        e = (W[:, i] - (q - Z[:, i]) * S[:, i]) / Hi[i, i]
        W[:, i:] -= e[:, None] * Hi[i, i:][None, :]
        Q[:, i], E[:, i] = q, e
    q_r, e_r = gptq_block_ref(W1, Hi, S, Z, grid.qmin, grid.qmax)
    _agree(q_r, Q, e_r, E)


@cpu_kernels
def test_gptq_with_the_kernel_matches_the_reference():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(512, 160, generator=g)
    W = torch.randn(24, 160, generator=g)
    grid = Grid(4, 32)
    ref = gptq(W, X.T @ X, grid, act_order=True, damp=0.01, block=64)
    out = gptq(W, X.T @ X, grid, act_order=True, damp=0.01, block=64, block_fn=kern.gptq_block_triton)
    assert torch.equal(ref[1], out[1]) and torch.equal(ref[2], out[2])  # static groups: same grid
    assert (ref[0] == out[0]).float().mean() >= 0.999


def test_dispatch_runs_the_reference_off_cuda():
    (W1, Hi, S, Z), grid = _block(8, 32, 32, 4)
    q, e = kern.gptq_block(W1, Hi, S, Z, grid.qmin, grid.qmax)
    q_r, e_r = gptq_block_ref(W1, Hi, S, Z, grid.qmin, grid.qmax)
    assert torch.equal(q, q_r) and torch.equal(e, e_r)


def test_bad_shapes_are_refused():
    (W1, Hi, S, Z), grid = _block(8, 32, 32, 4)
    with pytest.raises(ValueError, match="disagree"):
        kern.gptq_block_triton(W1, Hi[:16, :16], S, Z, grid.qmin, grid.qmax)


@pytest.mark.cuda
def test_cuda_gptq_kernel_matches_reference_at_smollm2_gate_up():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(2)
    X = (torch.randn(4096, 576, generator=g) * torch.rand(576, generator=g) * 4).cuda()
    W = (torch.randn(3072, 576, generator=g) * 0.05).cuda()
    grid = Grid(4, 128)
    H = X.T @ X
    ref = gptq(W, H, grid, act_order=True, damp=0.01)
    out = gptq(W, H, grid, act_order=True, damp=0.01, block_fn=kern.gptq_block)
    assert (ref[0] == out[0]).float().mean() >= 0.999

    def loss(q, s, z):  # GPTQ's objective: the output error over the calibration inputs
        w = grid.dequant(q, s, z, W.shape[1])
        return ((X @ (w - W).T) ** 2).sum().item()
    assert loss(*out) <= loss(*ref) * 1.001
