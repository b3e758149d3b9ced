"""relu: the gated MLP becomes ReLU-gated, the down-projection a sparse_down of the transposed
weight (exactly the same product), sparsity is measured per layer, and the mean correction is
the calibrated mean of the activation change pushed through the down-projection."""
import pytest
import torch
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.ops.sparse import relu_glu, sparse_down
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config
from llmaccel.ir import op_nodes, weight_of
from llmaccel.passes.relu import measure_sparsity

CALIB = {"calib_samples": "4", "calib_seq_len": "32"}
IDS = torch.Generator().manual_seed(0)


def _run(model, **opts):
    g = torch.Generator().manual_seed(0)
    ctx = PassContext(model.config, progress=Progress(False),
                      calib_source=lambda n, s: torch.randint(0, 512, (n, s), generator=g))
    cls = get_pass("relu")
    res = cls(make_config(cls, {**CALIB, **{k: str(v) for k, v in opts.items()}})).run(model.gm, ctx)
    res.gm.recompile()
    return res


def test_relu_ops_and_sparse_down_is_the_same_product():
    ids = torch.randint(0, 512, (2, 16), generator=IDS)
    dense = load("preset:tiny-llama")
    _run(dense, kind="relu", bias_correct="false", sparse_op="false")
    sparse = load("preset:tiny-llama")
    st = _run(sparse, kind="relu", bias_correct="false").stats
    assert dense.op_counts()["relu_mul"] == 2 and "silu_mul" not in dense.op_counts()
    assert sparse.op_counts()["sparse_down"] == 2 and sparse.op_counts()["linear"] == 12
    torch.testing.assert_close(sparse.logits(ids), dense.logits(ids), rtol=1e-5, atol=1e-5)
    assert len(st["sparsity_per_layer"]) == 2 and 0.3 < st["sparsity_mean"] < 0.7
    node = op_nodes(sparse.gm, sparse_down)[0]
    assert node.kwargs["sparsity"] == st["sparsity_per_layer"][0]
    assert "layers.0.down.weight" not in dict(sparse.gm.named_parameters())  # only the transpose kept


def test_drelu_is_sparser_and_computes_drelu():
    m = load("preset:tiny-llama")
    st = _run(m, kind="drelu", bias_correct="false").stats
    assert st["sparsity_mean"] > 0.65  # ~3/4 for independent signs of gate and up
    g, u = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(relu_glu(g, u, kind="drelu"), F.relu(g) * F.relu(u))
    torch.testing.assert_close(relu_glu(g, u, kind="relu", shift=0.5), F.relu(g - 0.5) * u)
    ids = torch.randint(0, 512, (1, 32), generator=IDS)
    assert measure_sparsity(m.gm, ids)[0] > 0.6


def test_shift_raises_sparsity():
    a, b = load("preset:tiny-llama"), load("preset:tiny-llama")
    assert _run(b, shift=0.3).stats["sparsity_mean"] > _run(a).stats["sparsity_mean"] + 0.05


def test_bias_correction_matches_the_mean_change():
    m = load("preset:tiny-llama")
    ref = load("preset:tiny-llama")
    w = weight_of(ref.gm, [n for n in ref.gm.graph.nodes if n.op == "get_attr"
                           and n.target == "layers.0.down.weight"][0]).clone()
    _run(m, kind="relu", sparse_op="false")
    down = op_nodes(m.gm, ops.linear)[6]  # q k v o gate up down: the 7th linear
    assert down.args[1].target == "layers.0.down.weight"
    bias = weight_of(m.gm, down.args[2])
    # layer 0's MLP input does not depend on the ReLUfication: recompute the mean change
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (4, 32), generator=g)
    from llmaccel.passes.relu import _probe
    mlp = op_nodes(ref.gm, ops.silu_mul)[0]
    gate, up = _probe(ref.gm, list(mlp.args[:2]), ids)
    delta = (F.silu(gate) * up - F.relu(gate) * up).flatten(0, 1).mean(0)
    torch.testing.assert_close(bias, w @ delta, rtol=1e-4, atol=1e-6)


def test_relu_after_fuse_then_heal():
    opts = {"relu": {**CALIB, "kind": "drelu"},
            "heal": {"steps": "2", "seq_len": "16", "batch": "2", "eval_windows": "2"}}
    m = compile("preset:tiny-llama", ["fuse", "relu", "heal"], opts, progress=False, eval_tokens=0)
    assert m.op_counts()["sparse_down"] == 2 and m.op_counts()["relu_glu"] == 2
    assert m.report["passes"][-1]["stats"]["params_trained"] > 0


def test_relu_needs_a_gated_mlp():
    with pytest.raises(LlmaccelError, match="no SiLU-gated MLP"):
        _run(load("preset:tiny-gpt2"))


def test_fit_refits_the_down_projections_to_the_mlp_outputs():
    """relu.fit: every down-projection's output error on the calibration tokens is at most what
    it was and falls on the mean; on fresh ids the fitted model is closer to the source (KL)."""
    from llmaccel.eval.domains import compare, graph_forward
    src, plain, fitted = load("preset:tiny-llama"), load("preset:tiny-llama"), load("preset:tiny-llama")
    fit = {"fit_samples": "32", "fit_seq_len": "64"}
    _run(plain, **fit)
    st = _run(fitted, fit="true", **fit).stats["fit"]
    assert st["modules"] == 2 and all(a <= b for b, a in st["per_module"])
    assert st["rel_err_after"] < 0.95 * st["rel_err_before"]
    ids = torch.randint(0, 512, (4, 48), generator=torch.Generator().manual_seed(99))
    res = compare(graph_forward(src.gm), {"plain": graph_forward(plain.gm), "fitted": graph_forward(fitted.gm)},
                  {"fresh": ids.flatten()}, ctx=48)["fresh"]
    assert res["fitted"]["kl"] < res["plain"]["kl"], res


def test_held_form_is_relu_glu_with_its_shift_in_a_tensor():
    """relu_glu_held (the training form) against relu_glu, the reference, on fresh random inputs:
    equal (fp32, exact op order) for relu and drelu, and in bf16 within bf16's rounding."""
    from llmaccel.ops.sparse import relu_glu_held
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    gate, up = torch.randn(4, 9, 33, generator=g), torch.randn(4, 9, 33, generator=g)
    for kind in ("relu", "drelu"):
        s = float(torch.rand((), generator=g))
        ref = relu_glu(gate, up, kind=kind, shift=s)
        torch.testing.assert_close(relu_glu_held(gate, up, torch.tensor(s), kind=kind), ref, rtol=0, atol=0)
        out = relu_glu_held(gate.bfloat16(), up.bfloat16(), torch.tensor(s), kind=kind)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_shift_for_gives_the_target_zeros():
    """The solved shift zeroes ceil(target x N) activations of all layers together: relu by the
    gates alone, drelu counting the negative ups as zeros at any shift."""
    from llmaccel.passes.relu import shift_for
    g = torch.Generator().manual_seed(1)
    gates = [torch.randn(3, 7, 40, generator=g) for _ in range(3)]
    ups = [torch.randn(3, 7, 40, generator=g) for _ in range(3)]
    n = sum(t.numel() for t in gates)
    for kind, target in (("relu", 0.7), ("drelu", 0.85), ("relu", 0.31)):
        s = shift_for(gates, ups, kind, target)
        zeros = sum((relu_glu(a, b, kind=kind, shift=s) == 0).sum().item() for a, b in zip(gates, ups))
        assert abs(zeros / n - target) <= 1 / n, (kind, zeros / n)
    with pytest.raises(LlmaccelError, match="already"):
        shift_for(gates, ups, "drelu", 0.3)


def test_sparsity_target_sets_the_shift():
    a, b = load("preset:tiny-llama"), load("preset:tiny-llama")
    lo, hi = _run(a, sparsity=0.8).stats, _run(b, kind="drelu", sparsity=0.9).stats
    assert lo["shift"] > 0 and hi["shift"] != 0
    # solved on the source's gates; the rewritten earlier layers move later gates a little
    assert abs(lo["sparsity_mean"] - 0.8) < 0.05 and abs(hi["sparsity_mean"] - 0.9) < 0.05, (lo, hi)
    assert not lo["held_through_heal"]
    assert op_nodes(a.gm, relu_glu)[0].kwargs["shift"] == pytest.approx(lo["shift"], abs=1e-6)
    with pytest.raises(LlmaccelError, match="not both"):
        make_config(get_pass("relu"), {"sparsity": "0.7", "shift": "0.2"})
    with pytest.raises(LlmaccelError, match=r"\[0, 1\)"):
        make_config(get_pass("relu"), {"sparsity": "1.2"})


def test_heal_holds_the_target_sparsity():
    """With a heal after it, relu holds its target sparsity: the shift moves with the weights
    (the heal's steps are large, so a fixed shift would drift), the healed graph is back in its
    inference form (relu_glu with a float shift, no buffer) at the target on the same tokens."""
    calib = {"calib_samples": "4", "calib_seq_len": "32"}
    opts = {"relu": {**calib, "sparsity": "0.7"},
            "heal": {"steps": "8", "seq_len": "16", "batch": "2", "eval_windows": "2", "lr": "3e-2"}}
    m = compile("preset:tiny-llama", ["relu", "heal"], opts, progress=False, eval_tokens=0)
    relu_st, heal_st = (p["stats"] for p in m.report["passes"])
    held = heal_st["relu_held"]
    assert relu_st["held_through_heal"] and held["target"] == 0.7
    assert abs(held["sparsity_mean"] - 0.7) < 0.01, held
    assert held["shift"] != relu_st["shift"]
    assert m.op_counts().get("relu_glu_held", 0) == 0 and m.op_counts()["relu_glu"] == 2
    assert "relu_shift" not in dict(m.gm.named_buffers()) and not hasattr(m.gm, "relu_hold")
    acts = op_nodes(m.gm, relu_glu)
    assert all(a.kwargs["shift"] == pytest.approx(held["shift"], abs=1e-6) for a in acts)
    assert [n.kwargs["sparsity"] for n in op_nodes(m.gm, sparse_down)] == held["sparsity_per_layer"]


def test_ramp_rewrites_at_shift_0_and_the_heal_raises_the_sparsity_to_its_target():
    """relu.ramp: the pass ReLUfies at shift 0 (the graph's own sparsity), the held target rises
    linearly to relu.sparsity over the first `ramp` of the heal and ends there."""
    calib = {"calib_samples": "4", "calib_seq_len": "32"}
    opts = {"relu": {**calib, "sparsity": "0.8", "ramp": "0.5"},
            "heal": {"steps": "8", "seq_len": "16", "batch": "2", "eval_windows": "2", "lr": "3e-2"}}
    m = compile("preset:tiny-llama", ["relu", "heal"], opts, progress=False, eval_tokens=0)
    relu_st, heal_st = (p["stats"] for p in m.report["passes"])
    assert relu_st["shift"] == 0 and relu_st["ramp"] == 0.5 and relu_st["held_through_heal"]
    assert relu_st["sparsity_mean"] < 0.7, relu_st     # ReLU alone, far from the target
    held = heal_st["relu_held"]
    assert held["target"] == 0.8 and abs(held["sparsity_mean"] - 0.8) < 0.01, held
    assert held["shift"] > 0
    # the schedule: the start at progress 0, linear to the target at the ramp's end, then flat
    from llmaccel.passes.relu import _Hold
    h = _Hold(torch.zeros(1, 2, dtype=torch.long), 0.8, "relu", torch.float32, start=0.5, ramp=0.5)
    assert [h.target_at(f) for f in (0.0, 0.25, 0.5, 0.9, 1.0)] == pytest.approx([0.5, 0.65, 0.8, 0.8, 0.8])
    with pytest.raises(LlmaccelError, match="add heal"):
        _run(load("preset:tiny-llama"), sparsity=0.8, ramp=0.5)
    with pytest.raises(LlmaccelError, match="set relu.sparsity too"):
        make_config(get_pass("relu"), {"ramp": "0.5"})
    with pytest.raises(LlmaccelError, match=r"\[0, 1\)"):
        make_config(get_pass("relu"), {"sparsity": "0.7", "ramp": "1"})


@pytest.mark.filterwarnings("ignore:.*has no tokenizer")
def test_a_relu_artifact_is_held_again_at_a_new_sparsity(tmp_path):
    """An artifact healed further: relu on its ReLUfied graph solves the shift again for
    relu.sparsity and holds it through the heal; weights, bias and kind stay; the fit and
    another kind are refused."""
    calib = {"calib_samples": "4", "calib_seq_len": "32"}
    first = compile("preset:tiny-llama", ["relu"], {"relu": {**calib, "sparsity": "0.6"}},
                    progress=False, eval_tokens=0)
    first.save(tmp_path / "a", first.report)
    weights = dict(first.gm.named_parameters())
    heal = {"steps": "8", "seq_len": "16", "batch": "2", "eval_windows": "2", "lr": "3e-2"}
    m = compile(str(tmp_path / "a"), ["relu", "heal"], {"relu": {**calib, "sparsity": "0.8"}, "heal": heal},
                baseline="preset:tiny-llama", progress=False, eval_tokens=0)
    relu_st, heal_st = (p["stats"] for p in m.report["passes"])
    assert relu_st["retargeted"] and relu_st["shift"] > relu_st["shift_before"]
    assert abs(relu_st["sparsity_mean"] - 0.8) < 0.02 and relu_st["held_through_heal"]
    assert abs(heal_st["relu_held"]["sparsity_mean"] - 0.8) < 0.01   # held through the heal
    assert m.op_counts()["relu_glu"] == 2 and m.op_counts()["sparse_down"] == 2
    alone = compile(str(tmp_path / "a"), ["relu"], {"relu": {**calib, "sparsity": "0.8"}},
                    baseline="preset:tiny-llama", progress=False, eval_tokens=0)
    assert all(torch.equal(v, weights[k]) for k, v in alone.gm.named_parameters())
    refused = (({"kind": "drelu"}, "kind relu, not relu.kind=drelu"), ({"fit": "true"}, "ReLUfied already"))
    for bad, match in refused:
        with pytest.raises(LlmaccelError, match=match):
            compile(str(tmp_path / "a"), ["relu"], {"relu": {**calib, "sparsity": "0.8", **bad}},
                    baseline="preset:tiny-llama", progress=False, eval_tokens=0)
    with pytest.raises(LlmaccelError, match="takes relu.sparsity"):
        compile(str(tmp_path / "a"), ["relu"], {"relu": calib}, baseline="preset:tiny-llama",
                progress=False, eval_tokens=0)


def test_heal_finish_without_the_hold_keeps_the_shift_it_has():
    """A module rebuilt between relu and heal loses the hold (a plain attribute): the training
    form still ends as relu_glu, with the shift its buffer holds."""
    m = load("preset:tiny-llama")
    g = torch.Generator().manual_seed(0)
    ctx = PassContext(m.config, progress=Progress(False), trained=True,
                      calib_source=lambda n, s: torch.randint(0, 512, (n, s), generator=g))
    relu = get_pass("relu")
    st = relu(make_config(relu, {**CALIB, "sparsity": "0.7"})).run(m.gm, ctx).stats
    del m.gm.relu_hold
    assert relu.training_form(m.gm).finish() == {"relu_held": {"shift": pytest.approx(st["shift"], abs=1e-6), "held": False}}
    assert m.op_counts()["relu_glu"] == 2 and "relu_shift" not in dict(m.gm.named_buffers())


def test_heal_holds_the_sparsity_of_a_bf16_model():
    """A model in bf16 heals with fp32 master weights beside its other bf16 weights: the hold
    probes it under autocast (as the heal's own measurements do), and hands back bf16."""
    from llmaccel.passes.base import PassContext
    m, src = load("preset:tiny-llama", dtype=torch.bfloat16), load("preset:tiny-llama", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ctx = PassContext(m.config, progress=Progress(False), source_model=src, trained=True,
                      calib_source=lambda n, s: torch.randint(0, 512, (n, s), generator=g))
    relu, heal = get_pass("relu"), get_pass("heal")
    relu(make_config(relu, {**CALIB, "sparsity": "0.7"})).run(m.gm, ctx).gm.recompile()
    ctx.trained = False
    st = heal(make_config(heal, {"steps": "4", "seq_len": "16", "batch": "2", "eval_windows": "2",
                                 "lr": "3e-2", "dtype": "bfloat16"})).run(m.gm, ctx).stats
    assert abs(st["relu_held"]["sparsity_mean"] - 0.7) < 0.02, st["relu_held"]
    assert all(p.dtype == torch.bfloat16 for p in m.gm.parameters() if p.is_floating_point())
