"""heal's data and report: windows sampled by the engine from calibration openings and built-in
openings of other kinds (shape, token range, seeded); ΔPPL / KL / top-1 on every evaluation
domain before, during and after the heal; the plot script draws them."""
import gc
import weakref
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from llmaccel.compiler.model import load
from llmaccel.errors import LlmaccelError
from llmaccel.eval.domains import DOMAINS
from llmaccel.eval.prompts import PROMPTS
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import make_config
from llmaccel.heal.data import resolve_prompts
from llmaccel.passes.sampled import prompt_ids
from llmaccel.runtime.windows import sample_windows
from llmaccel.runtime import engine as engine_mod
from llmaccel.runtime import windows as windows_mod

from tests.heal.test_heal import _ctx, _damage

SRC = "preset:tiny-llama"


def _calib(n=6, t=40):
    return torch.randint(0, 512, (n, t), generator=torch.Generator().manual_seed(3))


def test_prompt_kinds():
    m = load(SRC)
    calib = _calib()
    assert resolve_prompts("auto", m) == "calib"   # a preset has no tokenizer
    ps = prompt_ids(m, calib, 8, "calib", 12, calib_share=0.5)
    assert ps == [calib[i % 6, :12].tolist() for i in range(8)]
    mixed = prompt_ids(m, calib, 8, "mixed", 12, calib_share=0.5)
    # every other prompt is a built-in opening (a preset: its UTF-8 bytes, cut to 12 tokens)
    assert mixed[0::2] == [calib[i, :12].tolist() for i in range(4)]
    assert mixed[1::2] == [list(PROMPTS[i].encode())[:12] for i in range(4)]
    # a quarter from calibration openings, evenly spread: every fourth prompt
    quarter = prompt_ids(m, calib, 8, "mixed", 12, calib_share=0.25)
    assert quarter[0::4] == [calib[i, :12].tolist() for i in range(2)]
    assert [p for i, p in enumerate(quarter) if i % 4] == [list(PROMPTS[i].encode())[:12] for i in range(6)]
    assert prompt_ids(m, calib, 3, "mixed", 12, calib_share=0.0) == [list(PROMPTS[i].encode())[:12] for i in range(3)]
    assert prompt_ids(m, calib, 3, "mixed", 12, calib_share=1.0) == ps[:3]
    with pytest.raises(LlmaccelError, match="heal.prompts"):
        prompt_ids(m, calib, 2, "other", 12, calib_share=0.5)
    with pytest.raises(LlmaccelError, match="heal.calib_share"):
        make_config(get_pass("heal"), {"calib_share": "1.5"})
    for key, bad in (("temperature", "0"), ("top_p", "0"), ("top_p", "1.5")):
        with pytest.raises(LlmaccelError, match=f"heal.{key}"):
            make_config(get_pass("heal"), {key: bad})


def test_sample_windows_seeded_and_cache_freed(monkeypatch):
    m = load(SRC)
    made = []

    class Recorded(engine_mod.LLM):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append((self.core.cache, self.dtype, self.device))

    monkeypatch.setattr(windows_mod, "LLM", Recorded)
    prompts = prompt_ids(m, _calib(), 6, "mixed", 8, calib_share=0.5)
    a, st = sample_windows(m, prompts, 16, seed=1, max_seqs=4)
    assert a.shape == (6, 16) and a.dtype == torch.long
    assert 0 <= a.min() and a.max() < m.config.vocab_size
    assert all(a[i, :8].tolist() == p for i, p in enumerate(prompts))
    assert st["sampled_tokens"] == 6 * 8 and st["sample_tok_s"] > 0
    # the engine ran over the model's own dtype and device, and nothing holds its KV cache now
    cache, dtype, device = made[0]
    assert (dtype, device) == (m.dtype, m.device)
    ref = weakref.ref(cache)
    del made[:], cache
    gc.collect()
    assert ref() is None
    b, _ = sample_windows(m, prompts, 16, seed=1, max_seqs=6)   # batched differently
    c, _ = sample_windows(m, prompts, 16, seed=2, max_seqs=4)
    assert torch.equal(a, b)
    assert not torch.equal(a[:, 8:], c[:, 8:])
    with pytest.raises(LlmaccelError, match="prompt"):
        sample_windows(m, [list(range(30))], 16, seed=0, max_seqs=1)


def test_streamed_windows_are_the_batched_ones_and_stop_ends_early():
    import threading
    m = load(SRC)
    prompts = prompt_ids(m, _calib(), 6, "mixed", 8, calib_share=0.5)
    a, _ = sample_windows(m, prompts, 16, seed=1, max_seqs=4)
    got, ready = [], threading.Event()
    none, st = sample_windows(m, prompts, 16, seed=1, max_seqs=2, deliver=got.append, ready=ready)
    assert none is None and ready.is_set() and st["windows"] == 6 and st["sampled_tokens"] == 48
    # each request is seeded by its index: the same windows, in finishing order
    assert sorted(w.tolist() for w in got) == sorted(a.tolist())
    stop, got = threading.Event(), []
    stop.set()
    assert sample_windows(m, prompts, 16, seed=1, max_seqs=2, deliver=got.append, stop=stop)[1]["windows"] == 0
    # held back by begin until stopped: nothing sampled
    assert sample_windows(m, prompts, 16, seed=1, max_seqs=2, deliver=got.append, stop=stop,
                          begin=threading.Event())[1]["windows"] == 0 and not got


def test_windows_sampled_in_a_process_of_its_own_are_the_same():
    """apart: the engine in a spawned process that loads the model again from its source gives
    the windows of the engine in this one (seeded per request); a model that cannot be loaded
    again from its source is an error that says so."""
    import threading
    m = load(SRC)
    prompts = prompt_ids(m, _calib(), 6, "mixed", 8, calib_share=0.5)
    a, _ = sample_windows(m, prompts, 16, seed=1, max_seqs=4)
    got, ready = [], threading.Event()
    none, st = sample_windows(m, prompts, 16, seed=1, max_seqs=2, deliver=got.append, ready=ready,
                              apart=True)
    assert none is None and ready.is_set() and st["windows"] == 6
    assert sorted(w.tolist() for w in got) == sorted(a.tolist())
    # the sampling settings reach the process: a near-zero top-p keeps only the likeliest token,
    # so every seed gives the same (greedy) windows
    greedy, _ = sample_windows(m, prompts, 16, seed=1, max_seqs=4, temperature=0.7, top_p=1e-6)
    assert torch.equal(greedy, sample_windows(m, prompts, 16, seed=2, max_seqs=4, top_p=1e-6)[0])
    assert not torch.equal(greedy, a)
    got = []
    sample_windows(m, prompts, 16, seed=3, max_seqs=2, deliver=got.append, apart=True, top_p=1e-6)
    assert sorted(w.tolist() for w in got) == sorted(greedy.tolist())
    m.source = "preset:no-such-model"
    with pytest.raises(LlmaccelError, match="process of its own failed: .*no-such-model"):
        sample_windows(m, prompts, 16, seed=1, max_seqs=2, deliver=got.append, apart=True)


def test_the_sampling_child_sends_in_order_gathering_waiting_windows():
    import queue
    import threading
    from multiprocessing.connection import Pipe
    from llmaccel.runtime.windows import _send_all

    here, there = Pipe(duplex=False)
    out = queue.SimpleQueue()
    for m in [("windows", [[0]]), ("windows", [[1]]), ("ready",), ("windows", [[2]]), ("stats", {}),
              ("windows", [[3]]), ("windows", [[4]]), None]:
        out.put(m)
    t = threading.Thread(target=_send_all, args=(there, out))
    t.start()
    t.join(10)
    got = []
    while here.poll(1):
        got.append(here.recv())
        if got[-1] is None:
            break
    assert not t.is_alive()
    assert got == [("windows", [[0], [1]]), ("ready",), ("windows", [[2]]), ("stats", {}),
                   ("windows", [[3], [4]]), None]


def test_sampling_apart_does_not_run_the_callers_script_again(tmp_path):
    """The child is a Python started to run windows._child, not a multiprocessing spawn, which
    would import the caller's main script again: a script without an `if __name__ == "__main__"`
    guard runs once."""
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import llmaccel\n"
        "print('BODY', flush=True)\n"
        "m = llmaccel.compile('preset:tiny-llama', ['relu', 'heal'], {'heal': {'steps': '6', "
        "'refresh': '8', 'refresh_in': 'process', 'seq_len': '16', 'batch': '2', 'eval_windows': '2', "
        f"'domain_tokens': '0'}}}}, calib={str(Path('llmaccel/data/wikitext2/wiki.test.raw').resolve())!r}, progress=False)\n"
        "print('ERROR', m.report['passes'][-1]['stats'].get('refresh_error'))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("BODY") == 1 and "ERROR None" in out.stdout


def _refresh_heal(sampler, refresh=4, steps=4, **opts):
    m = load(SRC)
    _damage(m)
    ctx = _ctx(SRC, m)
    ctx.sampler = sampler
    cls = get_pass("heal")
    heal = cls(make_config(cls, {"steps": str(steps), "seq_len": "16", "batch": "2", "eval_windows": "2",
                                 "domain_tokens": "0", "refresh": str(refresh), **opts}))
    return heal.run(m.gm, ctx).stats


def test_refresh_windows_are_trained_on_first_as_they_arrive():
    seen = []

    def sampler(model, prompts, length, *, seed, max_seqs, deliver, stop, ready, begin, **_):
        seen.append((len(prompts), length, seed, max_seqs))
        for i in range(len(prompts)):   # all delivered before training starts: deterministic
            deliver(torch.full((length,), 7 + i, dtype=torch.long))
        ready.set()
        return None, {"sample_tok_s": 1.0}

    st = _refresh_heal(sampler)
    # seeded apart from heal.seed's windows; heal.sample_batch auto: 16 sequences at once on a CPU
    assert seen == [(4, 17, 1, 16)]
    assert st["refresh_windows"] == 4 and st["refresh_trained"] == 4 and "refresh_error" not in st
    assert st["distinct_windows"] == 8   # 4 steps x 2: the 4 fresh ones, then 4 of the file's
    assert _refresh_heal(sampler, sample_batch="3") and seen[-1][3] == 3


def test_refresh_sampling_begins_after_the_first_training_step():
    seen = {}

    def gated(model, prompts, length, *, seed, max_seqs, deliver, stop, ready, begin, **_):
        ready.set()
        seen["before"] = begin.is_set()    # training has not compiled its step yet
        seen["after"] = begin.wait(60)
        for i in range(len(prompts)):
            deliver(torch.full((length,), 7 + i, dtype=torch.long))
        return None, {"sample_tok_s": 1.0}

    st = _refresh_heal(gated, steps=3)
    assert seen == {"before": False, "after": True} and "refresh_error" not in st


def test_refresh_apart_samples_from_the_start_and_is_not_waited_for():
    """In a process of its own the sampler gets no begin event (nothing to hold it back for) and
    the heal does not wait for it to be ready: its windows are trained on as they arrive."""
    seen = {}

    def apart(model, prompts, length, *, seed, max_seqs, deliver, stop, ready, begin, apart=False, **_):
        seen.update(apart=apart, begin=begin)
        for i in range(len(prompts)):
            deliver(torch.full((length,), 7 + i, dtype=torch.long))
        assert stop.wait(60)               # ready never set: the heal went on without it
        return None, {"sample_tok_s": 1.0}

    st = _refresh_heal(apart, steps=3, refresh_in="process")
    assert seen == {"apart": True, "begin": None} and "refresh_error" not in st
    assert st["refresh_in"] == "process"
    assert st["steps"] == 3 and st["refresh_windows"] <= 4


def test_compile_starts_sampling_apart_before_the_first_pass_and_stops_it_when_a_pass_fails(monkeypatch):
    """A heal whose engine samples in a process of its own starts it before the compile's first
    pass (its start-up overlaps them), trains on its windows from the first step, and a compile
    that fails before the heal runs stops it."""
    import threading
    import llmaccel
    started, stopped = threading.Event(), threading.Event()

    def apart(model, prompts, length, *, seed, max_seqs, deliver, stop, ready, begin, apart=False, **_):
        for i in range(len(prompts)):
            deliver(torch.full((length,), 7 + i, dtype=torch.long))
        started.set()
        assert stop.wait(60)
        stopped.set()
        return None, {"sample_tok_s": 1.0}

    relu = get_pass("relu")
    run = relu.run
    fail = []

    def relu_run(self, gm, ctx):
        assert started.wait(30)            # the heal's sampler runs before the first pass does
        if fail:
            raise LlmaccelError("relu failed")
        return run(self, gm, ctx)

    monkeypatch.setattr(relu, "run", relu_run)
    opts = {"heal": {"steps": "2", "seq_len": "16", "batch": "2", "eval_windows": "2", "domain_tokens": "0",
                     "refresh": "4", "refresh_in": "process"}}
    calib = "llmaccel/data/wikitext2/wiki.test.raw"
    m = llmaccel.compile(SRC, ["relu", "heal"], opts, calib=calib, progress=False, sampler=apart)
    st = m.report["passes"][-1]["stats"]
    assert stopped.is_set() and st["refresh_in"] == "process" and st["refresh_first_step"] == 0
    assert st["refresh_trained"] == 4 and "refresh_error" not in st
    started.clear()
    stopped.clear()
    fail.append(True)
    with pytest.raises(LlmaccelError, match="relu failed"):
        llmaccel.compile(SRC, ["relu", "heal"], opts, calib=calib, progress=False, sampler=apart)
    assert stopped.is_set()


def test_a_sampling_process_that_fails_before_its_first_window_hands_over_to_a_thread():
    said = []

    def no_room(model, prompts, length, *, seed, max_seqs, deliver, stop, ready, begin, apart=False, **_):
        if apart:
            raise RuntimeError("no room for a second copy")
        ready.set()
        for i in range(len(prompts)):
            deliver(torch.full((length,), 7 + i, dtype=torch.long))
        return None, {"sample_tok_s": 1.0}

    m = load(SRC)
    ctx = _ctx(SRC, m)
    ctx.progress.log = said.append
    ctx.sampler = no_room
    cls = get_pass("heal")
    st = cls(make_config(cls, {"steps": "4", "seq_len": "16", "batch": "2", "eval_windows": "2",
                               "domain_tokens": "0", "refresh": "4", "refresh_in": "process"})).run(m.gm, ctx).stats
    assert st["refresh_in"] == "thread" and "refresh_error" not in st
    assert st["refresh_apart_error"] == "RuntimeError: no room for a second copy"
    assert any("sampling on a thread instead" in s for s in said)
    assert 0 <= st["refresh_trained"] <= st["refresh_windows"] <= 4


def test_out_of_memory_names_the_options_that_free_it(monkeypatch):
    """A step that runs out of device memory: one error naming heal.batch, and heal.refresh
    when the engine samples beside training (its KV cache is then on the device too)."""
    from llmaccel.heal import train as heal_train

    def oom(self, *a, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(heal_train.Trainer, "step", oom)

    def idle(model, prompts, length, *, seed, max_seqs, deliver, stop, ready, begin, **_):
        ready.set()
        return None, {"sample_tok_s": 0.0}

    with pytest.raises(LlmaccelError, match=r"heal.batch lower or heal.refresh=0"):
        _refresh_heal(idle)
    with pytest.raises(LlmaccelError, match=r"heal.batch lower$"):
        _refresh_heal(idle, refresh=0)


def test_refresh_stops_with_training_and_reports_a_failed_sampler():
    def waits(model, prompts, length, *, seed, max_seqs, deliver, stop, ready, begin, **_):
        ready.set()
        assert stop.wait(60)               # nothing delivered until training ends and stops it
        return None, {"sample_tok_s": 0.0}

    st = _refresh_heal(waits, steps=2)
    assert st["refresh_windows"] == 0 and st["refresh_trained"] == 0 and st["steps"] == 2
    assert st["refresh_in"] == "thread"   # auto on a CPU

    def fails(model, prompts, length, **kw):
        raise RuntimeError("no engine here")

    st = _refresh_heal(fails, steps=2)
    assert st["refresh_error"] == "RuntimeError: no engine here" and st["steps"] == 2
    said = []
    ctx = _ctx(SRC, load(SRC))
    ctx.progress.log = said.append    # also said when it happens, not only in the report
    ctx.sampler = fails
    cls = get_pass("heal")
    cls(make_config(cls, {"steps": "2", "seq_len": "16", "batch": "2", "eval_windows": "2",
                          "domain_tokens": "0", "refresh": "4"})).run(load(SRC).gm, ctx)
    assert any("sampling beside training failed (RuntimeError: no engine here)" in m for m in said)
    with pytest.raises(LlmaccelError, match="heal.refresh"):
        make_config(get_pass("heal"), {"refresh": "-2"})


@pytest.mark.parametrize("where", ["thread", "process"])
def test_refresh_with_the_engine(where):
    st = _refresh_heal(sample_windows, refresh=8, steps=6, refresh_in=where)
    assert "refresh_error" not in st and 0 <= st["refresh_trained"] <= st["refresh_windows"] <= 8
    assert st["kl_after"] < st["kl_before"]


def test_heal_reports_every_domain_before_during_after():
    m = load(SRC)
    _damage(m)
    cls = get_pass("heal")
    opts = dict(steps=6, seq_len=32, batch=2, eval_windows=2, lr=3e-3, sampled=4, prompts="mixed",
                domain_tokens=128, domain_evals=2)
    st = cls(make_config(cls, {k: str(v) for k, v in opts.items()})).run(m.gm, _ctx(SRC, m)).stats
    assert st["prompts"] == "mixed" and st["sampled_tokens"] == 4 * (33 - 16)
    assert set(st["domains"]) == set(DOMAINS)
    for dom, r in st["domains"].items():
        assert r["tokens"] == 128 and r["source_ppl"] > 1
        for when in ("before", "after"):
            f = r[when]
            assert math.isfinite(f["kl"]) and f["kl"] >= 0 and 0 <= f["top1"] <= 1
            assert math.isfinite(f["ppl"]) and f["ppl"] > 1
    curve = st["domain_curve"]
    # before, two points during (after steps 2 and 4 of 6), after
    assert curve["steps"] == [0, 2, 4, 6] and curve["train_tokens"] == [0, 128, 256, 384]
    for dom in DOMAINS:
        assert curve["kl"][dom][0] == st["domains"][dom]["before"]["kl"]
        assert curve["kl"][dom][-1] == st["domains"][dom]["after"]["kl"]
    # a damaged model heals towards the source on the domains it never trained on as well
    assert sum(curve["kl"][d][-1] for d in DOMAINS) < sum(curve["kl"][d][0] for d in DOMAINS)
    assert st["domain_eval_s"] >= 0 and "loss_curve" in st and "kl_after" in st


def test_heal_domain_report_can_be_off():
    m = load(SRC)
    cls = get_pass("heal")
    st = cls(make_config(cls, {"steps": "1", "seq_len": "16", "batch": "1", "eval_windows": "1",
                               "domain_tokens": "0"})).run(m.gm, _ctx(SRC, m)).stats
    assert st["domains"].startswith("skipped") and "domain_curve" not in st


def test_plot_script_draws_loss_and_domain_curves(tmp_path):
    pytest.importorskip("matplotlib")
    path = Path(__file__).resolve().parents[2] / "scripts" / "plot_heal.py"
    spec = importlib.util.spec_from_file_location("plot_heal", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    doms = {d: {"tokens": 8, "source_ppl": 10.0, "before": {"delta_ppl_pct": 50.0},
                "after": {"delta_ppl_pct": 5.0}} for d in DOMAINS}
    st = {"steps": 4, "loss_curve_every": 1, "loss_curve": [1.0, 0.5, 0.4, 0.3], "sampled_windows": 2,
          "delta_ppl_pct_before": 40.0, "delta_ppl_pct_after": 4.0, "domains": doms,
          "domain_curve": {"steps": [0, 2, 4], "kl": {d: [1.0, 0.5, 0.2] for d in DOMAINS}}}
    out = tmp_path / "heal.png"
    mod.plot_stats([("gqa", st)], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # an artifact's heal.png: the report's heal runs, labelled by the passes before them
    from llmaccel.eval.heal_plot import heal_runs, write_heal_plot
    rep = {"source": "/models/x.gguf", "passes": [{"name": "relu", "stats": {"kind": "drelu"}},
                                                  {"name": "heal", "stats": st}]}
    assert heal_runs(rep) == [("drelu", st)]
    assert write_heal_plot(rep, tmp_path / "a.png") and (tmp_path / "a.png").stat().st_size > 1000
    assert not write_heal_plot({"passes": [{"name": "fuse", "stats": {}}]}, tmp_path / "b.png")
    assert not (tmp_path / "b.png").exists()


@pytest.mark.real
def test_real_mixed_prompts_use_the_tokenizer():
    m = load("smollm2-135m")
    assert resolve_prompts("auto", m) == "mixed"
    calib = torch.tensor([m.encode("The history of the city begins in the twelfth century.")])
    ps = prompt_ids(m, calib, 2, "mixed", 8, calib_share=0.5)
    assert ps[0] == calib[0, :8].tolist() and ps[1] == m.encode(PROMPTS[0])[:8]
    w, st = sample_windows(m, ps, 16, seed=0, max_seqs=2)
    assert w.shape == (2, 16) and st["sampled_tokens"] == 16
    assert m.tokenizer.decode(w[1, :8]).startswith("def merge_sorted")


def test_domain_plan_auto_and_validation():
    cfg = make_config(get_pass("heal"), {})
    assert cfg.domain_plan("cuda:0") == (2048, 4) and cfg.domain_plan("cpu") == (512, 1)
    cfg = make_config(get_pass("heal"), {"domain_tokens": "64", "domain_evals": "0"})
    assert cfg.domain_plan("cuda") == (64, 0)
    with pytest.raises(LlmaccelError, match="heal.domain_evals"):
        make_config(get_pass("heal"), {"domain_evals": "-2"})
