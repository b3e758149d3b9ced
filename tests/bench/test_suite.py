"""python -m llmaccel.bench.suite: the GPU suite run end to end on the CPU at tiny shapes, its
records for failures, time limits and the deadline, and the closing table's ratios."""
import itertools
import json
import os
import signal
import sys
import time

import pytest

from llmaccel.bench import suite
from llmaccel.bench.suite_rows import Job, Options, plan
from llmaccel.bench.suite_table import table


def _py(label: str, code: str, limit: int = 60, result: str | None = None) -> Job:
    return Job("t", label, ("-c", code), limit, result=result)


def test_suite_small_on_cpu(tmp_path, capsys):
    peers = tmp_path / "peers"
    peers.mkdir()
    (peers / "peer_fast.py").write_text("raise SystemExit('a peer must not run on the CPU')\n")
    out = tmp_path / "out"
    rc = suite.main(["--device", "cpu", "--small", "--rows", "b1", "load", "kernels", "w4compile",
                     "--peers", str(peers), "--out", str(out)])
    printed = capsys.readouterr().out
    recs = [json.loads(line) for line in (out / "suite.jsonl").read_text().splitlines()]
    by = {r["label"]: r for r in recs}
    assert rc == 0, printed
    assert [r["label"] for r in recs] == ["fast_llama-1b_bs1", "llmc_llama-1b_bs1", "load_llama-1b_256",
                                          "runtime_kernels", "compile_w4_smollm2-135m"]
    assert by["fast_llama-1b_bs1"]["status"] == "skipped" and "CUDA" in by["fast_llama-1b_bs1"]["reason"]
    assert by["runtime_kernels"]["status"] == "skipped"
    bench = by["llmc_llama-1b_bs1"]
    assert bench["status"] == "ok" and bench["result"]["src"] == "preset:tiny-llama"
    assert bench["result"]["decode_tok_s"] > 0 and bench["result"]["gen"] == 4
    load = by["load_llama-1b_256"]["result"]["load"]
    assert len(load) == 1 and load[0]["requests"] == 8 and load[0]["intact"] is True
    for label in ("llmc_llama-1b_bs1", "load_llama-1b_256"):
        assert (out / f"{label}.log").read_text().startswith("$ ")
    assert "llama-1b bs1" in printed and "serving load: 8 requests" in printed
    assert "skipped runtime_kernels: needs CUDA" in printed
    w4 = by["compile_w4_smollm2-135m"]["result"]["passes"][0]
    assert w4["name"] == "quant" and w4["seconds"] > 0 and (out / "w4_compile" / "model.safetensors").exists()
    assert "W4 compile (awq+gptq, 128 windows) of preset:tiny-llama: quant pass" in printed


def test_records_of_failures_limits_and_deadline(tmp_path):
    jobs = [_py("good", "print('noise'); print('{\"decode_tok_s\": 5.0}')"),
            _py("crash", "print('last words'); raise SystemExit(3)"),
            _py("slow", "import time; time.sleep(30)", limit=1),
            _py("silent", "print('no figures')", result="missing.json"),
            _py("late", "print('{}')")]
    clock = itertools.chain([0, 0, 1, 2, 3], itertools.repeat(520))  # the start, then one per job
    recs = suite.run_suite(jobs, tmp_path, deadline_s=560, min_left_s=60, echo=lambda *a: None,
                           clock=lambda: next(clock))
    by = {r["label"]: r for r in recs}
    assert by["good"]["status"] == "ok" and by["good"]["result"] == {"decode_tok_s": 5.0}
    assert by["crash"]["status"] == "failed" and by["crash"]["error"] == "exit code 3"
    assert "last words" in by["crash"]["tail"]
    assert by["slow"]["error"].startswith("time limit")
    assert by["silent"]["error"] == "no JSON in missing.json" and "no figures" in by["silent"]["tail"]
    assert by["late"]["status"] == "skipped" and by["late"]["reason"].startswith("out of time")
    lines = (tmp_path / "suite.jsonl").read_text().splitlines()
    assert [json.loads(x)["label"] for x in lines] == ["good", "crash", "slow", "silent", "late"]


def test_time_limit_ends_the_row_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    rec = suite.run_suite([_py("parent", code, limit=2)], tmp_path, 560, echo=lambda *a: None)[0]
    assert rec["error"].startswith("time limit")
    pid = int(pid_file.read_text())
    for _ in range(50):  # the orphan is reaped by init shortly after its group is killed
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the row's child outlived its time limit")


def test_stale_result_file_is_not_reused(tmp_path):
    (tmp_path / "r.json").write_text('{"old": 1}')
    recs = suite.run_suite([_py("r", "pass", result="r.json")], tmp_path, 560, echo=lambda *a: None)
    assert recs[0]["status"] == "failed"


def test_table_ratios():
    def ok(label, tok_s, **kw):
        return {"row": "x", "label": label, "status": "ok", "result": {"decode_tok_s": tok_s, **kw}}
    recs = [ok("fast_llama-1b_bs1", 600.0), ok("llmc_llama-1b_bs1", 900.0, step_ms=1.0),
            ok("llmc_llama-1b_bs1_sampled", 855.0),
            {"row": "w4", "label": "llmc_llama-1b-int4_bs1", "status": "failed", "error": "exit code 1",
             "tail": "boom"}]
    text = table(recs)
    b1 = next(line for line in text.splitlines() if line.startswith("llama-1b bs1 "))
    assert "1.50x" in b1 and "1,150" in b1 and "0.78x" in b1          # 900 / 600, 900 / 1150
    sampled = next(line for line in text.splitlines() if line.startswith("llama-1b bs1 sampled"))
    assert "855*" in sampled and "1.00x" in sampled                    # goal 0.95 x 900
    assert "FAILED llmc_llama-1b-int4_bs1: exit code 1" in text


def test_bad_arguments_exit_2(capsys):
    assert suite.main(["--rows", "b1", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown row 'nope'" in err[0]
    assert suite.main(["--deadline", "0"]) == 2


def test_peers_and_serve_reasons(tmp_path, monkeypatch):
    a = suite.parse_args(["--peers", str(tmp_path), "--rows", "b1"])
    o = suite.options(a)
    assert o.peers is None and "peer_fast.py" in o.peer_skip
    assert plan(["b1"], o)[0].skip == o.peer_skip
    assert suite.options(suite.parse_args(["--no-peer"])).peer_skip == "--no-peer"
    assert [j.row for j in plan(["goals"], Options())][-1] == "load"
    monkeypatch.setattr(suite.importlib.util, "find_spec", lambda name: None)
    assert "--wheels" in suite.serve_setup(None, tmp_path / "deps")[2]
    pre, path, why = suite.serve_setup(tmp_path, tmp_path / "deps")
    assert why is None and path == str(tmp_path / "deps")
    assert pre[0][:3] == [sys.executable, "-m", "pip"] and "--no-index" in pre[0] and "fastapi" in pre[0]
    (tmp_path / "deps" / "fastapi").mkdir(parents=True)
    assert suite.serve_setup(tmp_path, tmp_path / "deps") == ([], str(tmp_path / "deps"), None)
    assert "no wheel folder" in suite.serve_setup(tmp_path / "none", tmp_path / "deps")[2]


@pytest.mark.parametrize("small", [False, True])
def test_every_row_plans(small):
    o = Options(device="cpu" if small else "cuda", small=small)
    jobs = plan(["all"], o)
    assert len({j.label for j in jobs}) == len(jobs)
    for j in jobs:
        if small and j.skip is None:
            assert "preset:tiny-llama" in j.argv or "--small" in j.argv, j.label


def test_sla_llm_row_benches_sla_beside_the_source(tmp_path, capsys):
    out = tmp_path / "out"
    assert suite.main(["--device", "cpu", "--small", "--rows", "sla_llm", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    by = {r["label"]: r for r in map(json.loads, (out / "suite.jsonl").read_text().splitlines())}
    sla = by["llmc_smollm2-135m-sla-w64_bs8"]
    assert sla["status"] == "ok" and sla["result"]["decode_tok_s"] > 0
    assert "sla" in sla["result"]["passes"] and by["llmc_smollm2-135m_bs8"]["status"] == "ok"
    assert "sla window 64 + 4 sinks bs8 through LLM:" in printed
