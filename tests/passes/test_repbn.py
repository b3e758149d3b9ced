"""repbn: the BN ops match their formulas; calibration records the norm inputs' statistics; the
folded graph computes what the BN graph computes; the training form at lam = 1 is the source
model; the finished training form folds exactly like the path without heal; artifacts round-trip."""
import operator

import pytest
import torch

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.ops import repbn as rops
from llmaccel.ops.attention import ContiguousKVCache
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config
from llmaccel.heal.heal import trainable_weights
from llmaccel.ir import op_nodes, weight_of
from llmaccel.passes.repbn import RepBN

SRCS = ["preset:tiny-llama", "preset:tiny-gpt2"]
NORM_OPS = (ops.rms_norm, ops.layer_norm, ops.add_rms_norm, ops.add_layer_norm,
            rops.repbn_blend, rops.batch_norm, rops.norm_affine)
OPTS = {"samples": "4", "seq_len": "32", "time_reps": "1", "time_tokens": "8", "clamp": "0"}


def _ctx(model, trained=False):
    def calib(n, s):  # the same ids on every call, so two runs calibrate alike
        return torch.randint(0, model.config.vocab_size, (n, s), generator=torch.Generator().manual_seed(0))
    return PassContext(model.config, progress=Progress(False), calib_source=calib, trained=trained)


def _repbn(model, trained=False, **opts):
    cfg = make_config(RepBN, {**OPTS, **{k: str(v) for k, v in opts.items()}})
    res = RepBN(cfg).run(model.gm, _ctx(model, trained))
    res.gm.graph.lint()
    res.gm.recompile()
    return res.stats


def _close(out, ref, rel):
    torch.testing.assert_close(out, ref, rtol=rel, atol=rel * ref.abs().max().item())


def _ids(T=24):
    return torch.randint(0, 512, (2, T), generator=torch.Generator().manual_seed(7))


def test_ops_match_their_formulas():
    x = torch.randn(3, 5, 16) * 2 + 0.5
    mean, var = torch.randn(16), torch.rand(16) + 0.1
    g, b, eps = torch.randn(16), torch.randn(16), 1e-5
    ref = (x - mean) / torch.sqrt(var + eps) * g + b
    _close(rops.batch_norm(x, mean, var, g, b, eps=eps), ref, 1e-6)
    a, c = g / torch.sqrt(var + eps), b - mean * g / torch.sqrt(var + eps)
    _close(rops.norm_affine(x, a, c), ref, 1e-5)
    w, nb = torch.randn(16), torch.randn(16)
    for kind, norm in (("rms", ops.rms_norm(x, w, eps=eps)), ("layer", ops.layer_norm(x, w, nb, eps=eps))):
        bias = nb if kind == "layer" else None
        blend = lambda lam: rops.repbn_blend(x, w, bias, mean, var, g, b, torch.tensor(lam),  # noqa: E731
                                             kind=kind, eps=eps)
        assert torch.equal(blend(1.0), norm)
        _close(blend(0.0), ref, 1e-6)
        _close(blend(0.3), 0.3 * norm + 0.7 * ref, 1e-6)
    gp = g.clone().requires_grad_(True)
    rops.repbn_blend(x, w, None, mean, var, gp, b, torch.tensor(0.5), kind="rms", eps=eps).sum().backward()
    assert gp.grad is not None and gp.grad.abs().sum() > 0


def _norm_inputs(model, ids):
    """The input of every norm of the unmodified model on ids, by norm order."""
    got = []

    class Probe(torch.fx.Interpreter):
        def run_node(self, n):
            if n.op == "call_function" and n.target in (ops.rms_norm, ops.layer_norm):
                got.append(self.fetch_args_kwargs_from_env(n)[0][0].flatten(0, 1))
            return super().run_node(n)
    Probe(model.gm).run(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    return got


@pytest.mark.parametrize("src", SRCS)
def test_calibrated_bn_equals_reference_formula(src):
    m = load(src)
    calib = _ctx(m).calib_tokens(4, 32)
    inputs = _norm_inputs(load(src), calib)
    norms = op_nodes(m.gm, ops.rms_norm, ops.layer_norm)
    weights = [weight_of(m.gm, n.args[1]) for n in norms]
    biases = [weight_of(m.gm, n.args[2]) if n.target is ops.layer_norm else None for n in norms]
    _repbn(m, trained=True, stats="source")
    blends = op_nodes(m.gm, rops.repbn_blend)
    assert len(blends) == len(inputs) == 2 * m.config.n_layers + 1
    for blend, h, w, b in zip(blends, inputs, weights, biases):
        mean, var = h.double().mean(0), h.double().var(0, unbiased=False)
        x = torch.randn(3, 7, h.shape[1]) * h.std() + h.mean()  # fresh inputs
        eps = blend.kwargs["eps"]
        ref = (x.double() - mean) / torch.sqrt(var + eps) * w.double() + (0.0 if b is None else b.double())
        out = rops.repbn_blend(x, *[weight_of(m.gm, a) for a in blend.args[1:]],
                               **blend.kwargs)
        _close(out.double(), ref, 1e-5)


def test_sequential_stats_see_earlier_bns():
    src = "preset:tiny-llama"
    a, b = load(src), load(src)
    _repbn(a, trained=True, stats="source")
    _repbn(b, trained=True, stats="sequential")
    ma = [weight_of(a.gm, n.args[3]) for n in op_nodes(a.gm, rops.repbn_blend)]
    mb = [weight_of(b.gm, n.args[3]) for n in op_nodes(b.gm, rops.repbn_blend)]
    torch.testing.assert_close(ma[0], mb[0])  # the first norm sees the embedding either way
    assert not torch.allclose(ma[-1], mb[-1])


@pytest.mark.parametrize("clamp", ["0", "1"])
@pytest.mark.parametrize("src", SRCS)
def test_training_form_lam1_is_source_and_finish_folds_exactly(src, clamp):
    ids = _ids()
    ref = load(src).logits(ids)
    m = load(src)
    st = _repbn(m, trained=True, clamp=clamp)
    assert st["form"].startswith("training") and st["norm_ops_after"] == 0
    RepBN.training_form(m.gm).schedule(0.0)
    _close(m.logits(ids), ref, 1e-5)  # lam = 1: the source model
    RepBN.training_form(m.gm).schedule(1.0)
    # Stand-in for training: move gamma, beta and the norm weights away from their start.
    g = torch.Generator().manual_seed(3)
    for n in op_nodes(m.gm, rops.repbn_blend):
        for a in (n.args[1], n.args[5], n.args[6]):
            if a is not None:
                t = weight_of(m.gm, a)
                t.add_(0.1 * torch.randn(t.shape, generator=g))
    bn = m.logits(ids)
    fin = RepBN.training_form(m.gm).finish()
    assert fin["repbn_norms_folded"] == 2 * m.config.n_layers + 1 and fin["repbn_affine_kept"] == 0
    assert not op_nodes(m.gm, *NORM_OPS)
    _close(m.logits(ids), bn, 1e-4)
    assert RepBN.training_form(m.gm).finish() == {}


@pytest.mark.parametrize("clamp", ["0", "1"])
@pytest.mark.parametrize("src", SRCS)
def test_heal_finish_equals_inference_path(src, clamp):
    ids = _ids()
    a, b = load(src), load(src)
    st = _repbn(a, clamp=clamp)
    assert st["form"] == "inference" and st["norms_removed"] == st["norms_replaced"]
    assert st["norm_ops_before"] == 2 * a.config.n_layers + 1 and st["norm_ops_after"] == 0
    assert st["ops_after"] == st["ops_before"] - st["norm_ops_before"] + st["clamps_kept"]
    assert st["clamps_kept"] == (st["norms_replaced"] if clamp == "1" else 0)
    assert st["forward_ms_before"] > 0 and st["forward_ms_after"] > 0
    assert st["lm_head_untied"] == a.config.tie_word_embeddings
    assert not op_nodes(a.gm, *NORM_OPS)
    _repbn(b, trained=True, clamp=clamp)
    RepBN.training_form(b.gm).schedule(1.0)
    bn = b.logits(ids)
    RepBN.training_form(b.gm).finish()
    _close(a.logits(ids), b.logits(ids), 1e-6)
    _close(a.logits(ids), bn, 1e-4)
    assert a.op_counts() == b.op_counts()


def test_schedule_and_trainable_state():
    m = load("preset:tiny-llama")
    _repbn(m, trained=True, ramp="0.5")
    n = op_nodes(m.gm, rops.repbn_blend)[0]
    lam = weight_of(m.gm, n.args[7])
    for frac, want in ((0.0, 1.0), (0.25, 0.5), (0.5, 0.0), (1.0, 0.0)):
        RepBN.training_form(m.gm).schedule(frac)
        assert lam.item() == pytest.approx(want)
    names = set(trainable_weights(m.gm, embed=False))
    assert {n.args[5].target, n.args[6].target, n.args[1].target} <= names  # gamma, beta, norm weight
    assert not names & {n.args[3].target, n.args[4].target, n.args[7].target}  # stats, lam
    assert not isinstance(lam, torch.nn.Parameter)


@pytest.mark.parametrize("src", SRCS)
def test_compile_repbn_heal_leaves_no_norm(src):
    # small calibration: "self" text is sampled from the model, slow at the default 32 x 256
    opts = {"repbn": {"samples": 4, "seq_len": 32, "time_reps": 1},
            "heal": {"steps": 3, "seq_len": 16, "batch": 1, "eval_windows": 2}}
    m = compile(src, ["repbn", "heal"], opts,
                calib="self", eval_tokens=0, progress=False)
    assert not op_nodes(m.gm, *NORM_OPS)
    st = m.report["passes"][1]["stats"]
    assert st["repbn_norms_folded"] == 2 * m.config.n_layers + 1
    assert m.logits(_ids(8)).isfinite().all()


def test_artifact_round_trip_and_decode(tmp_path):
    src = "preset:tiny-gpt2"  # tied head: the fold unties it
    m = compile(src, ["repbn"], {"repbn": OPTS}, eval_tokens=0, progress=False)
    assert m.report["passes"][0]["stats"]["lm_head_untied"]
    m.save(tmp_path / "a", m.report)
    back = load(str(tmp_path / "a"))
    ids = _ids(10)[:1]
    torch.testing.assert_close(back.logits(ids), m.logits(ids))
    cache = ContiguousKVCache(1, 10, torch.float32, "cpu")
    steps = [back.logits(ids[:, :4], 0, cache)] + [back.logits(ids[:, t:t + 1], t, cache) for t in range(4, 10)]
    _close(torch.cat(steps, 1), m.logits(ids), 1e-4)


def test_reader_that_is_not_a_linear_keeps_an_affine_op():
    m = load("preset:tiny-llama")
    final = op_nodes(m.gm, ops.rms_norm)[-1]
    head = op_nodes(m.gm, ops.lm_head)[0]
    with m.gm.graph.inserting_before(head):
        scaled = m.gm.graph.call_function(operator.mul, (final, 1.5))
    head.args = (scaled, *head.args[1:])
    m.gm.recompile()
    st = _repbn(m, trained=True)
    assert st["affine_kept"] == 1 and st["norms_removed"] == 2 * m.config.n_layers
    RepBN.training_form(m.gm).schedule(1.0)
    bn = m.logits(_ids())
    RepBN.training_form(m.gm).finish()
    assert len(op_nodes(m.gm, rops.norm_affine)) == 1
    _close(m.logits(_ids()), bn, 1e-4)


def test_fused_graph_is_refused_and_options_checked():
    with pytest.raises(LlmaccelError, match="run repbn before fuse"):
        compile("preset:tiny-llama", ["fuse", "repbn"], {"repbn": OPTS}, eval_tokens=0, progress=False)
    # norms folded by fuse but not merged with the residual add: repbn still applies
    m = compile("preset:tiny-llama", ["fuse", "repbn"], {"fuse": {"add_norm": "false"}, "repbn": OPTS},
                eval_tokens=0, progress=False)
    assert not op_nodes(m.gm, *NORM_OPS)
    with pytest.raises(LlmaccelError, match="repbn.ramp"):
        make_config(get_pass("repbn"), {"ramp": "1.5"})
    with pytest.raises(LlmaccelError, match="no RMSNorm"):
        _repbn(m)


def test_clamp_bounds_norm_inputs_and_survives_fold_and_artifact(tmp_path):
    src = "preset:tiny-llama"
    ids = _ids()
    plain, clamped = load(src), load(src)
    _repbn(plain)
    st = _repbn(clamped, clamp="1")
    assert st["clamps_kept"] == 2 * clamped.config.n_layers + 1 and st["norm_ops_after"] == 0
    # on the calibration text itself every input is inside its range: nothing changes
    calib = _ctx(plain).calib_tokens(4, 32)
    _close(clamped.logits(calib), plain.logits(calib), 1e-5)
    # a token pushed far out of the calibrated range reaches the layers bounded
    for m in (plain, clamped):
        m.gm.embed.weight[ids[0, 3]] *= 1e3
    assert clamped.logits(ids).abs().max() < plain.logits(ids).abs().max()
    clamped.save(tmp_path / "c")
    torch.testing.assert_close(load(str(tmp_path / "c")).logits(ids), clamped.logits(ids))
    with pytest.raises(LlmaccelError, match="repbn.clamp"):
        make_config(get_pass("repbn"), {"clamp": "0.5"})
