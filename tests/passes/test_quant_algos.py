"""quant algorithms (llmaccel/quant/algorithms.py): properties of the range and clipping searches,
the source-target correction, act-order GPTQ in the stored layout, and the GQA o scaling and
source matching in graphs. Random inputs; quality itself is measured on SmolLM2 (docs/quality.md)."""
import pytest
import torch

from llmaccel.compiler.model import load
from llmaccel.ops import quant as qo
from llmaccel.quant import Grid, awq_clip, awq_scale, gptq, source_correct

from test_quant import rel_err, run_passes


def _outlier_weights(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    w[torch.rand(N, K, generator=g) < 0.01] *= 8      # a few outliers per row, as real weights have
    return w


def _group_err(w, wq, gs, weight=None):
    d = Grid(4, gs).pad(w - wq).pow(2)
    if weight is not None:
        d = d * Grid(4, gs).pad(weight[None])
    return d.reshape(w.shape[0], -1, gs).sum(-1)


def test_range_search_never_increases_weighted_group_error():
    w, gs = _outlier_weights(24, 80), 32                # 80: a padded last group
    weight = torch.rand(80) + 0.1
    plain = Grid(4, gs)
    for wt in (None, weight):
        ref = _group_err(w, plain.rtn(w), gs, wt)
        got = _group_err(w, Grid(4, gs, search=20).rtn(w, wt), gs, wt)
        assert (got <= ref + 1e-6).all()
        assert got.sum() < ref.sum()                    # and it does find better ranges
    s, z = Grid(4, gs, search=20).params(w, weight)
    assert s.shape == z.shape == (24, 3) and (s > 0).all() and z.min() >= 0 and z.max() <= 15


def test_clipping_never_increases_output_error_per_group():
    torch.manual_seed(0)
    x = torch.randn(256, 96) * (torch.rand(96) * 3)
    w, grid = _outlier_weights(16, 96, 1), Grid(4, 32)
    wc = awq_clip(x, w, grid)
    assert wc.shape == w.shape and (wc.abs() <= w.abs() + 1e-6).all()

    def out_err(wq):   # per (row, group) output error, as the search measures it
        d = (w - wq).reshape(16, 3, 32)
        return torch.einsum("ngk,tgk->ntg", d, x.reshape(256, 3, 32)).pow(2).mean(1)
    e_clip, e_plain = out_err(grid.rtn(wc)), out_err(grid.rtn(w))
    assert (e_clip <= e_plain * (1 + 1e-5)).all() and e_clip.sum() < e_plain.sum()


def test_source_correct_solves_the_asymmetric_least_squares():
    torch.manual_seed(0)
    x_src = torch.randn(400, 48) @ torch.randn(48, 48)
    x_q = x_src + 0.3 * torch.randn(400, 48)           # inputs after quantized layers
    w = torch.randn(20, 48)
    ws = source_correct(w, x_src, x_q, damp=1e-6)
    ref = x_src @ w.T
    # the least-squares solution via lstsq, and a better fit than leaving w alone
    sol = torch.linalg.lstsq(x_q.double(), ref.double()).solution.T.float()
    torch.testing.assert_close(ws, sol, rtol=1e-3, atol=1e-3)
    assert (x_q @ ws.T - ref).norm() < (x_q @ w.T - ref).norm()
    # identical inputs: nothing to correct, whatever the damping (the ridge pulls towards w)
    torch.testing.assert_close(source_correct(w, x_src, x_src, damp=0.01), w, rtol=0, atol=1e-3)
    # quantizing W* with GPTQ beats quantizing w on the error against the source outputs
    grid, H = Grid(4, 16), x_q.T @ x_q
    err = []
    for target in (w, ws):
        q, s, z = gptq(target, H, grid, act_order=False, damp=0.01)
        err.append((x_q @ grid.dequant(q, s, z, 48).T - ref).norm())
    assert err[1] < err[0]


@pytest.mark.parametrize("search", [0, 10])
def test_act_order_keeps_contiguous_groups_and_the_reference_op_matches(search):
    torch.manual_seed(0)
    N, K, gs = 12, 80, 32                              # padded last group
    X = torch.randn(300, K) * torch.rand(K) * 4
    W = torch.randn(N, K)
    grid = Grid(4, gs, search)
    q, s, z = gptq(W, X.T @ X, grid, act_order=True, damp=0.01)
    G = -(-K // gs)
    assert q.shape == (N, G * gs) and s.shape == z.shape == (N, G)
    assert q.min() >= 0 and q.max() <= 15 and (q == q.round()).all()
    assert (q[:, K:] == z.repeat_interleave(gs, 1)[:, K:]).all()  # padding dequantizes to 0
    wq = grid.dequant(q, s, z, K)
    x = torch.randn(3, K)
    packed = qo.pack_int4(q.reshape(N, G, gs).to(torch.uint8))
    out = qo.linear_int4(x, packed, s, qo.pack_zeros(z.to(torch.uint8)), group_size=gs)
    torch.testing.assert_close(out, x @ wq.T, rtol=1e-5, atol=1e-5)
    assert (X @ (W - wq).T).norm() < (X @ (W - Grid(4, gs).rtn(W)).T).norm()


def test_tied_awq_scale_is_equal_across_heads_sharing_a_kv_head():
    torch.manual_seed(0)
    n_kv, rep, hd = 2, 3, 8
    x = torch.randn(128, n_kv * rep * hd) * (torch.rand(n_kv * rep * hd) * 4 + 0.1)
    s = awq_scale(x, [torch.randn(10, n_kv * rep * hd)], Grid(4, 16), tie=(n_kv, rep))
    v = s.view(n_kv, rep, hd)
    assert torch.equal(v, v[:, :1].expand_as(v))


def test_gqa_o_scale_folds_into_v_exactly():
    # int8 AWQ is near-lossless: a wrong v-row / o-channel mapping would show as a large error
    ids = torch.randint(0, 512, (1, 20))
    ref = load("preset:tiny-llama").logits(ids)
    for order in (["quant"], ["fuse", "quant"]):
        m, st = run_passes("preset:tiny-llama", order, method="awq", bits=8)
        assert st["awq_skipped"] == {}
        assert rel_err(m.logits(ids), ref) < 0.05
    _, st = run_passes("preset:tiny-llama", ["quant"], method="awq", bits=8, gqa_o=False)
    assert st["awq_skipped"] == {"o after GQA attention": 2}


@pytest.mark.parametrize("order", [["quant"], ["fuse", "quant"]])
def test_match_source_and_range_search_in_graphs(order):
    ids = torch.randint(0, 512, (2, 17))
    ref = load("preset:tiny-llama").logits(ids)
    # 16 x 32 calibration tokens: the least-squares fit overfits the default 4 x 32 of these tests
    m, st = run_passes("preset:tiny-llama", order, method="awq+gptq", bits=4, match_source=True,
                       act_order=True, range_search=10, refit=True, awq_duo=True, n_samples=16)
    assert m.op_counts().get("linear", 0) == 0
    assert rel_err(m.logits(ids), ref) < 0.5
    m8, _ = run_passes("preset:tiny-llama", order, method="gptq", bits=8, match_source=True, n_samples=16)
    assert rel_err(m8.logits(ids), ref) < 0.1   # random weights and ids: the fit is noisy


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_refit_scales_never_increases_the_hessian_weighted_error(method):
    from llmaccel.quant import refit_scales
    torch.manual_seed(0)
    N, K, gs = 10, 80, 32
    X = torch.randn(400, K) @ torch.randn(K, K) * 0.3
    W, grid = _outlier_weights(N, K, 2), Grid(4, gs)
    H = X.T @ X
    if method == "rtn":
        s, z = grid.params(W)
        q = grid.codes(W, s, z)
    else:
        q, s, z = gptq(W, H, grid, act_order=False, damp=0.01)
    q[1, :gs] = z[1, 0]                                 # an all-zero group keeps a valid scale
    s2 = refit_scales(W, H, q, s, z, grid)
    assert s2.shape == s.shape and (s2 > 0).all()

    def err(sc):
        d = W - grid.dequant(q, sc, z, K)
        return torch.einsum("nk,kl,nl->n", d.double(), H.double(), d.double())
    assert (err(s2) <= err(s) * (1 + 1e-6)).all() and err(s2).sum() < err(s).sum()


def test_duo_scale_search_is_never_worse_on_its_objective():
    torch.manual_seed(0)
    x = torch.randn(256, 64) * (torch.rand(64) * 5 + 0.1)
    ws, grid = [_outlier_weights(24, 64, 3)], Grid(4, 16)
    ref = x @ ws[0].T

    def loss(s):
        return (x / s @ grid.rtn(ws[0] * s).T - ref).pow(2).mean()
    s1, s2 = awq_scale(x, ws, grid), awq_scale(x, ws, grid, duo=True)
    assert loss(s2) <= loss(s1) * (1 + 1e-6)
    s3 = awq_scale(x, ws, grid, duo=True, tie=(2, 2))
    v = s3.view(2, 2, 16)
    assert torch.allclose(v, v[:, :1].expand_as(v))
