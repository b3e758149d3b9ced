"""Layer-local fitting (`PASS.fit=true`) of gqa, sla, repbn and bitlinear on a tiny preset: on
fresh random inputs (not the calibration tokens) the fitted model is closer to the source than the
unfitted one, at every layer's output and in KL on the logits; on the calibration tokens every
fitted module's output error is at most what it was. And, on the real SmolLM2-135M, fitting
(gqa) lowers the KL to the source on Python source code, a domain no calibration reads."""
import operator

import pytest
import torch

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.eval.domains import compare, graph_forward
from llmaccel.ir import is_op, probe
from llmaccel.errors import LlmaccelError
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config
from llmaccel.passes.fitting import FitOptions, fit_windows
from llmaccel.runtime.windows import sample_windows

SRC = "preset:tiny-llama"
CASES = {
    "gqa": {"kv_heads": "1"},
    "sla": {},
    "repbn": {"time_reps": "0"},
    "bitlinear": {},
}
FIT = {"fit_samples": "64", "fit_seq_len": "64"}


def _run(name: str, fit: bool, model):
    def calib(n, s):  # the same calibration ids for both runs
        return torch.randint(0, model.config.vocab_size, (n, s), generator=torch.Generator().manual_seed(0))
    ctx = PassContext(model.config, progress=Progress(False), calib_source=calib, source_model=load(SRC),
                      sampler=sample_windows)  # repbn fits on sampled windows too (fit_data=mixed)
    cls = get_pass(name)
    res = cls(make_config(cls, {**CASES[name], **FIT, "fit": str(fit).lower()})).run(model.gm, ctx)
    res.gm.graph.lint()
    res.gm.recompile()
    return res


def _layer_outputs(gm, ids):
    """The residual stream after each layer (every second residual add), by node name."""
    adds = [n for n in gm.graph.nodes if is_op(n, operator.add)][1::2]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    return dict(zip([n.name for n in adds], probe(gm, adds)(ids, pos, None)))


@pytest.mark.parametrize("name", list(CASES))
def test_fit_lowers_layer_errors_and_kl_on_fresh_inputs(name):
    src, plain, fitted = load(SRC), load(SRC), load(SRC)
    _run(name, False, plain)
    st = _run(name, True, fitted).stats["fit"]
    assert st["modules"] > 0 and st["quality"].startswith("skipped")
    # calibration tokens: no module got worse, and the mean error fell by at least 5%
    assert all(a <= b for b, a in st["per_module"])
    assert st["rel_err_after"] < 0.95 * st["rel_err_before"]
    # fresh inputs (another seed than the calibration ids)
    ids = torch.randint(0, src.config.vocab_size, (4, 48), generator=torch.Generator().manual_seed(99))
    ref = _layer_outputs(src.gm, ids)
    errs = {}
    for label, m in (("plain", plain), ("fitted", fitted)):
        out = _layer_outputs(m.gm, ids)
        errs[label] = [((out[k] - r).pow(2).sum() / r.pow(2).sum()).item() for k, r in ref.items()]
    # every layer's output closer to the source's (10% slack: one layer may trade a little
    # for the next), and the last one strictly closer
    assert all(f <= 1.1 * p for f, p in zip(errs["fitted"], errs["plain"])), errs
    assert errs["fitted"][-1] < errs["plain"][-1], errs
    res = compare(graph_forward(src.gm), {"plain": graph_forward(plain.gm), "fitted": graph_forward(fitted.gm)},
                  {"fresh": ids.flatten()}, ctx=48)["fresh"]
    assert res["fitted"]["kl"] < res["plain"]["kl"], res


@pytest.mark.real
def test_real_fit_lowers_kl_on_python_code():
    """gqa kv_heads=1 on SmolLM2-135M, merged and fitted (W_o) on 768 tokens of wikitext2's first half;
    the pass's own report scores both models on the first 128 tokens of the Python source text."""
    from llmaccel.compiler.pipeline import compile

    opts = {"kv_heads": "1", "calib_samples": "4", "calib_seq_len": "128", "fit": "true",
            "fit_samples": "6", "fit_seq_len": "128", "fit_report_tokens": "128",
            "fit_qkv_steps": "0"}   # W_o only: the q/k/v fit doubles the time (test_gqa_fit.py checks it)
    m = compile("smollm2-135m", ["gqa"], {"gqa": opts}, calib="llmaccel/data/wikitext2/wiki.test.raw",
                calib_split="first-half", eval_tokens=0, progress=False)
    res = m.report["passes"][0]["stats"]["fit"]["quality"]["python-code"]
    assert res["tokens"] == 127
    assert res["fitted"]["kl"] < res["unfitted"]["kl"], res


def test_mixed_fit_data_needs_the_engines_sampler():
    """repbn's default fit text (half sampled by the engine) without a sampler: one clear error."""

    model = load(SRC)
    ctx = PassContext(model.config, progress=Progress(False), source_model=load(SRC),
                      calib_source=lambda n, s: torch.randint(0, 500, (n, s)))
    cls = get_pass("repbn")
    with pytest.raises(LlmaccelError, match="fit_data=mixed needs the engine"):
        cls(make_config(cls, {**CASES["repbn"], **FIT, "fit": "true"})).run(model.gm, ctx)


@pytest.mark.parametrize("name,opts", [*CASES.items(), ("relu", {"kind": "drelu", "shift": "0.25"})],
                         ids=[*CASES, "relu"])
def test_fit_runs_on_a_bfloat16_model(name, opts):
    """On a GPU the model is held in bfloat16: every pass's fit runs on it (its math in fp32),
    no module gets worse, and the fitted graph still runs in bfloat16 with finite logits."""
    bf16 = dict(dtype=torch.bfloat16)
    model = load(SRC, **bf16)
    ctx = PassContext(model.config, progress=Progress(False), source_model=load(SRC, **bf16),
                      calib_source=lambda n, s: torch.randint(0, 500, (n, s), generator=torch.Generator().manual_seed(0)),
                      sampler=sample_windows)
    cls = get_pass(name)
    res = cls(make_config(cls, {**opts, **FIT, "fit": "true"})).run(model.gm, ctx)
    res.gm.graph.lint()
    res.gm.recompile()
    st = res.stats["fit"]
    assert st["modules"] > 0 and all(a <= b for b, a in st["per_module"])
    floats = {k: v.dtype for k, v in res.gm.state_dict().items() if v.is_floating_point()}
    assert set(floats.values()) == {torch.bfloat16}, floats
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(5))
    logits = res.gm(ids, torch.arange(24).expand_as(ids), None)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("name", ["gqa", "sla"])
def test_fit_after_fuse_splits_and_fuses_again(name):
    """After `fuse` q, k and v are one linear; the fit (its q/k/v fit rewrites them one by one)
    splits it, fits, and leaves the graph fused, no module worse."""
    model = load(SRC)
    fused = get_pass("fuse")().run(model.gm, PassContext(model.config, progress=Progress(False)))
    n_linear = sum(is_op(n, ops.linear) for n in fused.gm.graph.nodes)
    model.gm = fused.gm
    st = _run(name, True, model)
    assert st.stats["fit"]["modules"] > 0 and all(a <= b for b, a in st.stats["fit"]["per_module"])
    assert sum(is_op(n, ops.linear) for n in st.gm.graph.nodes) == n_linear


def test_mixed_fit_windows_interleave_calibration_and_sampled_text():
    """Held-out choices take the second half of the rows: both halves hold both kinds of text."""
    model = load(SRC)
    calib = torch.arange(5 * 8).reshape(5, 8)
    def sampler(m, prompts, length, **k):   # every sampled token -1
        return -torch.ones(len(prompts), length, dtype=torch.long), {}
    ctx = PassContext(model.config, progress=Progress(False), source_model=model,
                      calib_source=lambda n, s: calib[:n, :s], sampler=sampler)
    ids = fit_windows(ctx, FitOptions(fit_samples=5, fit_seq_len=8, fit_data="mixed"))
    sampled = (ids < 0).all(dim=1).tolist()
    assert sampled == [False, True, False, True, False]
    assert torch.equal(ids[~torch.tensor(sampled)], calib[:3])


def test_fit_refuses_a_single_window():
    with pytest.raises(LlmaccelError, match="fit_samples and fit_seq_len must be >= 2"):
        FitOptions(fit_samples=1)
