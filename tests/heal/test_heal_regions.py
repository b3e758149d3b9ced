"""heal.regional: the heal view cut into one nested compile region per decoder layer computes
what the flat view computes (eager, and compiled with aot_eager: loss and gradients), alike
layers share one region, and a region that fails to compile falls back to the whole graph."""
import dataclasses
import math

import pytest
import torch

from llmaccel.compiler.families import capture
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.compiler.presets import PRESETS, random_weights
from llmaccel.heal import train as heal_train
from llmaccel.heal.heal import trainable_weights
from llmaccel.heal.regions import regional
from llmaccel.heal.train import Trainer, heal_view


def _four_layers():
    cfg = dataclasses.replace(PRESETS["tiny-llama"], n_layers=4)
    return capture(cfg, random_weights(cfg, std=0.15))


def _ids(n=2, t=24, seed=3):
    return torch.randint(0, 512, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make,passes", [
    (_four_layers, []),
    (lambda: load("preset:tiny-gpt2").gm, []),
    (lambda: compile("preset:tiny-llama", ["fuse"], {}, eval_tokens=0, progress=False).gm, []),
    (lambda: compile("preset:tiny-llama", ["gqa", "relu"], {"gqa": {"kv_heads": "1"}},
                     eval_tokens=0, progress=False).gm, []),
], ids=["llama-4-layers", "gpt2", "fused", "gqa-relu"])
def test_regions_compute_what_the_flat_view_computes(make, passes):
    gm = make()
    for hidden in (False, True):
        view, _ = heal_view(gm, hidden)
        reg = regional(view)
        assert reg is not view and reg.regions >= 1
        ids = _ids()
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        with torch.no_grad():
            for a, b in zip(view(ids, pos, None), reg(ids, pos, None)):
                torch.testing.assert_close(b, a, rtol=0, atol=0)


def _four_layers_fused():
    import llmaccel.compiler.presets as presets
    from llmaccel.compiler.pipeline import compile as compile_model

    cfg = dataclasses.replace(PRESETS["tiny-llama"], n_layers=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(presets.PRESETS, "tiny-llama-4", cfg)
        mp.setitem(presets._STD, "tiny-llama-4", 0.15)
        return compile_model("preset:tiny-llama-4", ["fuse"], {}, eval_tokens=0, progress=False).gm


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_distinct_regions_each_run_their_own_code(backend):
    """A fused graph with the hidden output cuts into several regions whose inputs look alike
    (same shapes and dtypes): compiled, each must still run its own segment."""
    view, _ = heal_view(_four_layers_fused(), True)
    reg = regional(view)
    assert reg.regions >= 2
    ids = _ids()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    torch._dynamo.reset()
    with torch.no_grad():
        want = view(ids, pos, None)
        got = torch.compile(reg, backend=backend, fullgraph=True, dynamic=False)(ids, pos, None)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_view_by_layer_refuses_a_cache():
    from llmaccel.errors import LlmaccelError

    view, _ = heal_view(_four_layers(), False)
    ids = _ids()
    with pytest.raises(LlmaccelError, match="without a KV cache"):
        regional(view)(ids, torch.arange(ids.shape[1]).expand_as(ids), object())


def test_alike_layers_share_one_region_and_the_final_norm_stays_outside():
    view, _ = heal_view(_four_layers(), False)
    reg = regional(view)
    assert reg.regions == 1
    calls = [n for n in reg.graph.nodes if n.op == "call_module"]
    assert len(calls) == 4 and {n.target for n in calls} == {"heal_region0"}


def test_compiled_regions_train_as_the_compiled_whole_graph():
    """aot_eager (Inductor on this CPU takes ~30 s a graph): the same losses step after step."""
    curves = {}
    for reg in (False, True):
        torch.manual_seed(0)
        student, teacher = _four_layers(), _four_layers()
        with torch.no_grad():   # a student away from its teacher
            for name, w in student.named_parameters():
                if "embed" not in name:
                    w.mul_(1.2)
        params = list(trainable_weights(student, False).values())
        for p in params:
            p.requires_grad_(True)
        tr = Trainer(student, teacher, params, lr=3e-3, hidden=0.0, dtype=None, backend="aot_eager",
                     kl_chunk=0, regional=reg)
        curves[reg] = [tr.step(_ids(2, 16, s), 3e-3).item() for s in range(4)]
        assert tr.regional is reg and tr.compile_error is None
    assert curves[True][-1] < curves[True][0]
    assert curves[True] == pytest.approx(curves[False], rel=1e-4, abs=1e-6)


def test_a_region_that_does_not_compile_falls_back_to_the_whole_graph(monkeypatch):
    def breaks(view):
        reg = regional(view)

        class Broken(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = reg

            def forward(self, *args):
                torch._dynamo.graph_break()   # fullgraph=True refuses it
                return self.inner(*args)
        return Broken()
    monkeypatch.setattr(heal_train, "regional", breaks)
    m, t = load("preset:tiny-llama"), load("preset:tiny-llama")
    params = list(trainable_weights(m.gm, False).values())
    for p in params:
        p.requires_grad_(True)
    logs = []
    tr = Trainer(m.gm, t.gm, params, lr=1e-3, hidden=0.0, dtype=None, backend="aot_eager",
                 kl_chunk=0, log=logs.append, regional=True)
    loss = tr.step(_ids(2, 8), 1e-3)
    assert math.isfinite(loss.item()) and tr.backend == "aot_eager" and not tr.regional
    assert tr.compile_error and "whole graph" in logs[0]


def test_without_nested_regions_the_whole_graph_compiles(monkeypatch):
    monkeypatch.delattr(torch.compiler, "nested_compile_region")
    view, _ = heal_view(_four_layers(), False)
    assert regional(view) is view
    m, t = load("preset:tiny-llama"), load("preset:tiny-llama")
    params = list(trainable_weights(m.gm, False).values())
    tr = Trainer(m.gm, t.gm, params, lr=1e-3, hidden=0.0, dtype=None, backend="aot_eager",
                 kl_chunk=0, regional=True)
    assert not tr.regional


@pytest.mark.parametrize("value,want_plain,want_sla", [
    ("auto", False, True), ("true", True, True), ("false", False, False), (True, True, True)])
def test_regional_auto_is_on_for_linear_attention_only(value, want_plain, want_sla):
    """auto: by layer where the graph has linear attention (its whole graph compiles slowest),
    the whole graph otherwise; true / false (or a bool from Python) force it."""
    from llmaccel.heal.config import HealConfig
    plain = load("preset:tiny-llama").gm
    sla = compile("preset:tiny-llama", ["sla"], {"sla": {"calib_samples": "2", "calib_seq_len": "32"}},
                  eval_tokens=0, progress=False).gm
    c = HealConfig(regional=value)
    assert (c.resolve_regional(plain), c.resolve_regional(sla)) == (want_plain, want_sla)
