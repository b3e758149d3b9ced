"""heal: distillation lowers the KL to the source on held-out windows; weights it must not touch
(integer/packed, scales of packed weights, the embedding unless asked) stay as they were; tied
weights stay tied; the loss curve lands in the report and the artifact."""
import json
import math
import os
import signal

import pytest
import torch

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config
from llmaccel.heal.heal import trainable_weights
from llmaccel.heal.train import Trainer, heal_view
from llmaccel.ir import op_nodes, weight_of
from llmaccel.runtime.windows import sample_windows


def _ctx(src, model):
    g = torch.Generator().manual_seed(0)
    return PassContext(model.config, progress=Progress(False), source_model=load(src),
                       calib_source=lambda n, s: torch.randint(0, 512, (n, s), generator=g),
                       sampler=sample_windows)


def _run(name, model, ctx, **opts):
    cls = get_pass(name)
    return cls(make_config(cls, {k: str(v) for k, v in opts.items()})).run(model.gm, ctx)


def _damage(model, scale=0.5):
    g = torch.Generator().manual_seed(1)
    for n in op_nodes(model.gm, ops.linear):
        w = weight_of(model.gm, n.args[1])
        w.add_(scale * w.std() * torch.randn(w.shape, generator=g))


@pytest.mark.parametrize("src", ["preset:tiny-llama", "preset:tiny-gpt2"])
def test_heal_reduces_held_out_kl(src):
    m = load(src)
    _damage(m)
    st = _run("heal", m, _ctx(src, m), steps=16, lr=3e-3, seq_len=32, batch=4, warmup=2).stats
    assert st["kl_after"] < 0.9 * st["kl_before"]
    assert st["delta_ppl_pct_after"] < st["delta_ppl_pct_before"]
    assert len(st["loss_curve"]) == 16 and st["loss_curve"][-1] < st["loss_curve"][0]
    assert all(not p.requires_grad for p in m.gm.parameters())


def test_heal_keeps_embedding_and_tied_weights():
    src = "preset:tiny-gpt2"  # tied embedding
    m = load(src)
    emb0 = m.gm.embed.weight.clone()
    _damage(m)
    _run("heal", m, _ctx(src, m), steps=3, seq_len=16, batch=2, eval_windows=2)
    assert torch.equal(m.gm.embed.weight, emb0)  # frozen by default
    _run("heal", m, _ctx(src, m), steps=3, seq_len=16, batch=2, eval_windows=2, embed="true", lr=1e-2)
    assert not torch.equal(m.gm.embed.weight, emb0)
    emb = [n for n in m.gm.graph.nodes if n.op == "get_attr" and n.target == "embed.weight"]
    users = {u.target for n in emb for u in n.users}
    assert users == {ops.embedding, ops.lm_head}  # one tensor still feeds both


def test_trainable_weights_skip_integer_and_their_scales():
    m = load("preset:tiny-llama")
    lin = op_nodes(m.gm, ops.linear)[0]
    from llmaccel.ir import add_weight
    q = add_weight(m.gm, "packed.qweight", torch.zeros(4, 4, dtype=torch.int8), lin)
    s = add_weight(m.gm, "packed.scales", torch.ones(4), lin)

    def fake_int_linear(x, qweight, scales):  # stands for any quantized op
        return x
    with m.gm.graph.inserting_after(lin):
        n = m.gm.graph.call_function(fake_int_linear, (lin, q, s))
    names = set(trainable_weights(m.gm, embed=False))
    assert "packed.qweight" not in names and "packed.scales" not in names
    assert "embed.weight" not in names and lin.args[1].target in names
    m.gm.graph.erase_node(n)


def test_hidden_loss_on_plain_and_fused_graphs():
    for passes in (["heal"], ["fuse", "heal"]):
        m = compile("preset:tiny-llama", passes, {"heal": {"steps": "2", "seq_len": "16", "batch": "2",
                                                           "eval_windows": "2", "hidden": "1.0"}},
                    progress=False, eval_tokens=0)
        st = m.report["passes"][-1]["stats"]
        assert st["kl_before"] < 1e-6 and len(st["loss_curve"]) == 2
    view, head = heal_view(load("preset:tiny-llama").gm, hidden=True)
    x, hidden = view(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], None)
    logits = torch.nn.functional.linear(x, head.weight, head.bias)
    assert logits.shape == (1, 3, 512) and hidden.shape == (1, 3, 64)


def test_gqa_fuse_heal_pipeline_report_and_artifact(tmp_path):
    opts = {"gqa": {"kv_heads": "1", "calib_samples": "2", "calib_seq_len": "16"},
            "heal": {"steps": "4", "seq_len": "16", "batch": "2", "eval_windows": "2"}}
    m = compile("preset:tiny-llama", ["gqa", "fuse", "heal"], opts, progress=False, eval_tokens=64)
    st = m.report["passes"][-1]["stats"]
    for k in ("ppl_before", "ppl_after", "delta_ppl_pct_before", "delta_ppl_pct_after", "loss_curve"):
        assert k in st
    m.save(tmp_path / "a", m.report)
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert rep["passes"][-1]["stats"]["loss_curve"] == st["loss_curve"]
    try:
        import matplotlib  # noqa: F401  (the plot extra: the artifact carries the heal's curves)
        assert (tmp_path / "a" / "heal.png").read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert not (tmp_path / "a" / "heal.png").exists()
    ids = torch.randint(0, 512, (1, 12))
    torch.testing.assert_close(load(str(tmp_path / "a")).logits(ids), m.logits(ids))


def test_heal_train_changed_trains_only_what_the_passes_changed():
    src, gqa = "preset:tiny-llama", {"kv_heads": "1", "calib_samples": "2", "calib_seq_len": "16"}
    heal = {"steps": "3", "seq_len": "16", "batch": "2", "eval_windows": "2", "lr": "1e-2",
            "train": "changed"}
    source = dict(load(src).gm.named_parameters())
    before = dict(compile(src, ["gqa"], {"gqa": gqa}, progress=False, eval_tokens=0).gm.named_parameters())
    m = compile(src, ["gqa", "heal"], {"gqa": gqa, "heal": heal}, progress=False, eval_tokens=0)
    changed = {k for k, v in before.items()
               if k not in source or source[k].shape != v.shape or not torch.equal(source[k], v)}
    moved = {k for k, v in m.gm.named_parameters() if not torch.equal(v, before[k])}
    mlp = {k for k in before if k.split(".")[-2] in ("mlp_norm", "gate", "up", "down")}
    assert mlp and not mlp & changed and any(".k." in k for k in changed)
    assert moved == changed - {"embed.weight"}
    assert m.report["passes"][-1]["stats"]["params_trained"] == sum(before[k].numel() for k in moved)
    with pytest.raises(LlmaccelError, match="passes changed"):
        compile(src, ["heal"], {"heal": heal}, progress=False, eval_tokens=0)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_heal_of_a_bf16_model_without_bf16_autocast(dtype):
    # the trained weights become fp32 masters; the frozen ones stay bf16 (train=changed freezes
    # the norms whose outputs feed the trained projections): it computes in bf16, trains, keeps bf16
    src, gqa = "preset:tiny-llama", {"kv_heads": "1", "calib_samples": "2", "calib_seq_len": "16"}
    heal = {"steps": "2", "seq_len": "16", "batch": "2", "eval_windows": "2", "lr": "1e-2",
            "train": "changed", "dtype": dtype}
    before = compile(src, ["gqa"], {"gqa": gqa}, progress=False, eval_tokens=0, dtype="bfloat16")
    m = compile(src, ["gqa", "heal"], {"gqa": gqa, "heal": heal}, progress=False, eval_tokens=0,
                dtype="bfloat16")
    st = m.report["passes"][-1]["stats"]
    assert st["dtype"] == "bfloat16" and math.isfinite(st["kl_after"])
    w = dict(m.gm.named_parameters())
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert any(not torch.equal(t, w[k]) for k, t in before.gm.named_parameters() if ".k." in k)


def test_heal_after_quant_if_available():
    try:
        m = compile("preset:tiny-llama", ["gqa", "quant", "fuse", "heal"],
                    {"gqa": {"calib_samples": "2", "calib_seq_len": "16"},
                     "quant": {"method": "rtn", "group_size": "32"},
                     "heal": {"steps": "2", "seq_len": "16", "batch": "2", "eval_windows": "2"}},
                    progress=False, eval_tokens=0)
    except LlmaccelError as e:
        pytest.skip(f"quant pass not usable here: {e}")
    ints = [t for t in m.gm.parameters() if not t.is_floating_point()]
    assert ints and m.report["passes"][-1]["stats"]["params_trained"] > 0


def test_heal_options_are_validated():
    with pytest.raises(LlmaccelError, match="heal.steps"):
        make_config(get_pass("heal"), {"steps": "0"})
    with pytest.raises(LlmaccelError, match="source model"):
        get_pass("heal")().run(load("preset:tiny-llama").gm, PassContext(load("preset:tiny-llama").config))


def test_heal_time_budget_stops_early_and_reports_steps_done(capsys):
    # random calibration windows: the budget, not the data, is under test (sampling 4,096
    # windows from the model took most of a minute on a loaded CPU)
    src = "preset:tiny-llama"
    m = load(src)
    _damage(m)
    ctx = _ctx(src, m)
    ctx.progress = Progress(True)
    st = _run("heal", m, ctx, steps=100000, seq_len=16, batch=1, eval_windows=2,
              minutes=0.02).stats
    assert 1 <= st["steps"] < 100000
    assert st["train_tokens"] == st["steps"] * 16
    # the bar counts percent of the budget, not of the 100,000 steps it stops long before
    bar = capsys.readouterr().err.split("\r")
    heal = [b for b in bar if b.startswith("heal:")]
    assert heal and "100/100" in heal[-1] and "100000" not in "".join(heal)
    assert "step=" in heal[-1] and "tok_s=" in heal[-1]


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_ends_the_heal_and_keeps_what_it_trained(monkeypatch, presses):
    # one Ctrl-C at the third step: training ends after it and the heal reports as usual; a
    # second one aborts as Ctrl-C does, and the usual handler is back either way
    src = "preset:tiny-llama"
    m = load(src)
    _damage(m)
    step = Trainer.step
    calls = []

    def pressing(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)
        return step(self, *a, **k)

    monkeypatch.setattr(Trainer, "step", pressing)
    usual = signal.getsignal(signal.SIGINT)
    if presses == 2:
        with pytest.raises(KeyboardInterrupt):
            _run("heal", m, _ctx(src, m), steps=20, seq_len=16, batch=1, eval_windows=2)
    else:
        st = _run("heal", m, _ctx(src, m), steps=20, seq_len=16, batch=1, eval_windows=2).stats
        assert st["steps"] == 3 == st["interrupted_at_step"] and len(calls) == 3
        assert st["kl_after"] < st["kl_before"]   # measured after the three steps it trained
    assert signal.getsignal(signal.SIGINT) is usual


@pytest.mark.filterwarnings("ignore:.*has no tokenizer")
def test_an_artifact_heals_further_against_its_baseline(tmp_path):
    first = compile("preset:tiny-llama", ["gqa"], {"gqa": {"kv_heads": "1"}}, eval_tokens=0, progress=False)
    first.save(tmp_path / "a", first.report)
    heal = {"heal": {"steps": "6", "seq_len": "16", "batch": "2", "eval_windows": "2"}}
    # without a baseline the artifact would be its own teacher, at KL 0: refused before any work
    for passes in (["heal"], ["fuse", "heal"]):
        with pytest.raises(LlmaccelError, match=r"own teacher.*--baseline.*\(preset:tiny-llama\)"):
            compile(str(tmp_path / "a"), passes, heal, progress=False)
    m = compile(str(tmp_path / "a"), ["heal"], heal, baseline="preset:tiny-llama", eval_tokens=64,
                progress=False)
    st = m.report["passes"][-1]["stats"]
    assert m.report["baseline"] == "preset:tiny-llama"
    assert 0.01 < st["kl_before"] and st["kl_after"] < st["kl_before"]
    assert [e["name"] for e in m.recipe] == ["gqa", "heal"]
    assert m.report["quality"]["kl"] > 0   # measured against the baseline, not the artifact
    with pytest.raises(LlmaccelError, match="family"):
        compile(str(tmp_path / "a"), ["heal"], heal, baseline="preset:tiny-gpt2", progress=False)


def test_sampled_windows_continue_calibration_prompts_and_train():
    src = "preset:tiny-llama"
    m = load(src)
    _damage(m)
    ctx = _ctx(src, m)
    heal = get_pass("heal")(make_config(get_pass("heal"), {"steps": "6", "seq_len": "40", "batch": "2",
                                                           "eval_windows": "2", "sampled": "5"}))
    train, held, refresh, _ = heal._data(ctx, 40, 2)
    calib = ctx.calib_tokens(12 + 2, 41)
    assert train.shape == (12 + 5, 41) and torch.equal(held, calib[-2:]) and refresh == 0
    file_rows = {tuple(r.tolist()) for r in calib[:-2]}
    sampled = [r for r in train if tuple(r.tolist()) not in file_rows]
    assert len(sampled) == 5  # every calibration window kept, five sampled ones added
    # a preset has no tokenizer, so the prompts are calibration openings: half the window (20
    # tokens) here, 32 in windows of 64 tokens or more
    by_prompt = {tuple(r[:20].tolist()): r for r in calib[:-2]}
    # each sampled window starts with a calibration window's first 20 tokens and goes on with
    # the source's own tokens (a 512-token vocabulary at temperature 1), not that window's
    assert all(tuple(r[:20].tolist()) in by_prompt for r in sampled)
    assert all(not torch.equal(r[20:], by_prompt[tuple(r[:20].tolist())][20:]) for r in sampled)
    st = heal.run(m.gm, ctx).stats
    assert st["sampled_windows"] == 5 and st["kl_after"] < st["kl_before"]
    with pytest.raises(LlmaccelError, match="heal.sampled"):
        make_config(get_pass("heal"), {"sampled": "-2"})


def test_sampled_and_refresh_auto_on_cuda_with_a_sampler_else_none():
    cfg = make_config(get_pass("heal"), {})
    m = load("preset:tiny-llama")
    able = PassContext(m.config, progress=Progress(False), source_model=m, sampler=sample_windows)
    assert cfg.sampled_windows(able, 0) == 0 and cfg.refresh_windows(able, 900, 100) == 0  # a CPU context
    assert not cfg.apart(able)
    able.device = "cuda:0"
    assert cfg.refresh_windows(able, 900, 100) == 65536 and cfg.apart(able)
    # windows sampled apart arrive while the first step compiles: none sampled before training
    assert cfg.sampled_windows(able, 32768) == 0 and cfg.sampled_windows(able, 0) == 2048
    threaded = make_config(get_pass("heal"), {"refresh_in": "thread"})
    assert not threaded.apart(able) and threaded.sampled_windows(able, 32768) == 2048
    # a heal that does not go round its windows samples no more, unless it runs on a budget
    assert cfg.refresh_windows(able, 100, 100) == 0
    assert make_config(get_pass("heal"), {"minutes": "5"}).refresh_windows(able, 100, 100) == 65536
    able.sampler = None  # compile() called without the engine's sampler: no sampling, no error
    assert cfg.sampled_windows(able, 0) == 0 and cfg.refresh_windows(able, 900, 100) == 0
    assert make_config(get_pass("heal"), {"sampled": "7"}).sampled_windows(able, 32768) == 7
    assert make_config(get_pass("heal"), {"refresh": "9"}).refresh_windows(able, 1, 100) == 9
