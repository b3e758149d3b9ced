"""heal's training step: the fp32 eager path trains exactly as plain autograd on full logits;
the chunked KL equals the unchunked one (loss and gradients); compiled forwards (aot_eager here:
Inductor on this CPU needs ~30-60 s per graph) give the eager losses without recompiling while
a training form's schedule moves; bf16 autocast trains fp32 master weights and hands back the
model's own dtype; throughput and sampling time are reported."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config
from llmaccel.heal.heal import _lr_at, kl_loss, trainable_weights
from llmaccel.heal.train import Head, Trainer, chunked_kl, heal_view

OPTS = dict(steps=6, lr=3e-3, seq_len=32, batch=4, warmup=2, eval_windows=2)


def _setup(src="preset:tiny-llama", dtype=torch.float32):
    m = load(src, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    for name, w in m.gm.named_parameters():  # damage every float weight but the embedding
        if w.is_floating_point() and "embed" not in name:
            w.add_(0.5 * w.float().std().to(w.dtype) * torch.randn(w.shape, generator=g).to(w.dtype))
    g0 = torch.Generator().manual_seed(0)
    ctx = PassContext(m.config, progress=Progress(False), source_model=load(src, dtype=dtype),
                      calib_source=lambda n, s: torch.randint(0, 512, (n, s), generator=g0))
    return m, ctx


def _heal(m, ctx, **opts):
    cls = get_pass("heal")
    heal = cls(make_config(cls, {k: str(v) for k, v in {**OPTS, **opts}.items()}))
    return heal, heal.run(m.gm, ctx).stats


def _reference_losses(m, ctx, heal):
    """The heal's loop written as plain autograd on full logits (the fp32 path before chunking
    and compilation): the same windows, lr schedule, clipping and AdamW."""
    c = heal.config
    train = heal._data(ctx, c.seq_len, c.batch)[0]
    params = list(trainable_weights(m.gm, False).values())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0)
    losses = []
    for step in range(c.steps):
        x = train[[(step * c.batch + j) % len(train) for j in range(c.batch)], :-1]
        pos = torch.arange(x.shape[1]).expand_as(x)
        with torch.no_grad():
            t = ctx.source_model.gm(x, pos, None)
        loss = kl_loss(m.gm(x, pos, None), t)
        opt.param_groups[0]["lr"] = _lr_at(step, step / c.steps, c)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def test_fp32_eager_path_is_plain_autograd_on_full_logits():
    ref, ref_ctx = _setup()
    for kl_chunk in (0, 24):  # all 128 rows at once; 24 rows at a time
        m, ctx = _setup()
        heal, st = _heal(m, ctx, dtype="float32", compile="off", kl_chunk=kl_chunk)
        assert st["dtype"] == "float32" and st["compiled"] == "off" and st["loss_curve_every"] == 1
        if kl_chunk == 0:
            want = _reference_losses(ref, ref_ctx, heal)
            assert want[-1] < want[0]
        # the curve is stored to 5 significant digits
        assert st["loss_curve"] == pytest.approx(want, rel=1e-4)
    # throughput fields: tokens per second of the training loop, sampling time apart
    assert st["train_tok_s"] > 0 and st["steady_tok_s"] > 0 and st["sample_s"] >= 0
    assert st["train_tok_s"] == pytest.approx(st["train_tokens"] / st["train_s"], rel=1e-3)


@pytest.mark.parametrize("head", ["lm_head", "bias", "logits"])
def test_chunked_kl_equals_unchunked_loss_and_gradients(head):
    g = torch.Generator().manual_seed(0)
    V, D = 97, 16
    hs = torch.randn(3, 10, D if head != "logits" else V, generator=g).requires_grad_(True)
    ht = torch.randn(hs.shape, generator=g)
    if head == "logits":
        sh = th = Head(None, None)
    else:
        w = torch.randn(V, D, generator=g).requires_grad_(True)
        b = torch.randn(V, generator=g).requires_grad_(True) if head == "bias" else None
        sh, th = Head(w, b), Head(torch.randn(V, D, generator=g), None)
    inputs = [t for t in (hs, sh.weight, sh.bias) if t is not None]

    def full():
        if sh.weight is None:
            return kl_loss(hs, ht)
        return kl_loss(F.linear(hs, sh.weight, sh.bias), F.linear(ht, th.weight))
    want = full()
    want_grads = torch.autograd.grad(want, inputs)
    for chunk in (0, 7, 30):
        got = chunked_kl(hs, sh, ht, th, chunk=chunk)
        assert abs(got.item() - want.item()) <= 1e-5
        for a, b in zip(torch.autograd.grad(got * 2.0, inputs), want_grads):
            torch.testing.assert_close(a, 2.0 * b, rtol=1e-5, atol=1e-6)


def test_compiled_forwards_match_eager_and_never_recompile_across_schedule_steps():
    # repbn's training form: its schedule moves its lam buffer every step
    opts = {"repbn": {"samples": 2, "seq_len": 16, "time_reps": 1, "ramp": 0.5},
            "heal": {"steps": 5, "seq_len": 16, "batch": 2, "eval_windows": 2}}
    curves = {}
    for mode in ("off", "aot_eager"):
        graphs = counters["stats"]["unique_graphs"]
        opts["heal"]["compile"] = mode
        m = compile("preset:tiny-llama", ["repbn", "heal"], opts, eval_tokens=0, progress=False)
        st = m.report["passes"][-1]["stats"]
        assert st["compiled"] == mode and "compile_error" not in st
        # torch.compile's own seconds, within the first step's, when it compiled
        assert ("compile_s" in st) == (mode != "off")
        assert mode == "off" or 0 < st["compile_s"] <= st["first_step_s"]
        curves[mode] = st["loss_curve"]
        # student, teacher and the KL rows: traced once each, whatever the schedule does
        assert counters["stats"]["unique_graphs"] - graphs <= (3 if mode != "off" else 0)
    assert len(set(curves["off"])) == 5  # the schedule did change the loss every step
    assert curves["aot_eager"] == pytest.approx(curves["off"], rel=1e-4, abs=1e-6)


def test_bf16_autocast_trains_fp32_master_weights_and_keeps_model_dtype():
    fp32, ctx = _setup()
    _, st32 = _heal(fp32, ctx, dtype="float32", compile="off")
    m, ctx = _setup(dtype=torch.bfloat16)
    seen = []
    real_step = Trainer._step

    def spy(self, x, lr):
        seen.append({p.dtype for p in self.params})
        return real_step(self, x, lr)
    Trainer._step = spy
    try:
        _, st = _heal(m, ctx, dtype="bfloat16", compile="off")
    finally:
        Trainer._step = real_step
    assert st["dtype"] == "bfloat16" and seen and all(s == {torch.float32} for s in seen)
    assert all(p.dtype == torch.bfloat16 for p in m.gm.parameters() if p.is_floating_point())
    assert st["loss_curve"][-1] < st["loss_curve"][0]
    # bf16 weights and matmuls: the same curve to a few percent
    assert st["loss_curve"] == pytest.approx(st32["loss_curve"], rel=0.05)


def test_failed_compilation_in_auto_mode_falls_back_to_eager():
    m, ctx = _setup()

    def broken(gm, inputs):
        raise RuntimeError("no backend here")
    params = list(trainable_weights(m.gm, False).values())
    for p in params:
        p.requires_grad_(True)
    logs = []
    tr = Trainer(m.gm, ctx.source_model.gm, params, lr=1e-3, hidden=0.0, dtype=None,
                 backend=broken, kl_chunk=0, log=logs.append)
    loss = tr.step(torch.randint(0, 512, (2, 8)), 1e-3)
    assert math.isfinite(loss.item()) and tr.backend is None
    assert "no backend here" in tr.compile_error and logs


@pytest.mark.parametrize("src", ["preset:tiny-llama", "preset:tiny-gpt2"])
def test_view_stops_before_the_head_with_the_same_values(src):
    gm = load(src).gm
    view, head = heal_view(gm, hidden=True)
    assert not any(n.target is ops.rope for n in view.graph.nodes)  # frequencies as buffers
    x = torch.randint(0, 512, (2, 9))
    pos = torch.arange(9).expand_as(x)
    h, resid = view(x, pos, None)
    assert torch.equal(F.linear(h, head.weight, head.bias), gm(x, pos, None))
    assert resid.shape == h.shape and not torch.equal(resid, h)


def test_throughput_script_small_prints_one_json_line(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_heal_throughput.py"
    spec = importlib.util.spec_from_file_location("gpu_heal_throughput", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "t.json"
    assert mod.main(["--small", "--steps", "3", "--old-steps", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res
    assert res["new"]["steps"] == 3 and res["old"]["steps"] == 2 and res["old"]["batch"] == 4
    assert res["new"]["train_tok_s"] > 0 and res["ratio_train_tok_s"] > 0
    assert mod.main(["--small", "--set", "heal.dtype=float64"]) == 2  # a bad option: one line
