"""kill -9 `llmc compile --force` at random points over an existing artifact, and check after
each kill that the folder still holds a whole artifact that loads and evaluates to the same
perplexity as before: the previous one, or the new one when the kill came after the swap.

    PYTHONPATH=. python scripts/kill_compiles.py --runs 20 [--seed 0]

Half the kills land at a uniform random time within a full compile's duration; the other half
wait for the hidden temporary folder to appear (the write has begun) and kill within 0..30 ms,
so the write itself is interrupted. Exit code 1 when any run leaves a broken artifact.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = "preset:tiny-llama"
OLD = ["--passes", "fuse"]
NEW = ["--passes", "quant", "--set", "quant.bits=8", "--set", "quant.method=rtn", "--eval-tokens", "0"]


def llmc(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "llmaccel.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def compile_to(out: Path, recipe: list[str], force: bool = False) -> None:
    p = llmc("compile", SRC, *recipe, "-o", str(out), *(["--force"] if force else []))
    _, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"compile failed: {err}")


def ppl(folder: Path) -> tuple[float, str]:
    """Perplexity on 256 seeded sampled tokens (windows of 64), and the recipe's first pass."""
    from llmaccel.compiler.model import load
    from llmaccel.eval.perplexity import evaluate
    from llmaccel.eval.text import load_tokens

    m = load(str(folder))
    ids = load_tokens(load(SRC), "self", "all", 256, ctx=64)
    return evaluate(m, ids, ctx=64, progress=False)["ppl"], m.recipe[0]["name"]


def temp_dirs(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.llmc-")]


def kill_run(out: Path, rng: random.Random, full_s: float, during_write: bool) -> float:
    p = llmc("compile", SRC, *NEW, "-o", str(out), "--force")
    t0 = time.perf_counter()
    if during_write:
        mine = f".{out.name}.llmc-{p.pid}-"
        while p.poll() is None and not any(d.name.startswith(mine) for d in temp_dirs(out)):
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.03))
    else:
        time.sleep(rng.uniform(0, full_s))
    at = time.perf_counter() - t0
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    p.wait()
    return at


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="llmc-kill-") as work:
        work = Path(work)
        out, ref_new = work / "art", work / "new"
        compile_to(out, OLD)
        t0 = time.perf_counter()
        compile_to(ref_new, NEW)
        full_s = time.perf_counter() - t0
        want = {"fuse": ppl(out)[0], "quant": ppl(ref_new)[0]}
        runs, bad = [], 0
        for i in range(a.runs):
            if ppl(out)[1] != "fuse":
                compile_to(out, OLD, force=True)  # the previous run finished: back to the old one
            during = i % 2 == 1
            at = kill_run(out, rng, full_s, during)
            try:
                got, recipe = ppl(out)
                ok = got == want[recipe]
            except Exception as e:  # noqa: BLE001 - any failure to load is what this counts
                got, recipe, ok = None, f"{type(e).__name__}: {e}", False
            bad += not ok
            runs.append({"run": i, "kill_at_s": round(at, 3), "during_write": during,
                         "artifact": recipe, "ppl": got, "same_ppl": ok,
                         "temp_left": len(temp_dirs(out))})
            print(json.dumps(runs[-1]), file=sys.stderr)
    print(json.dumps({"runs": a.runs, "broken": bad, "full_compile_s": round(full_s, 2),
                      "ppl": want, "kept_previous": sum(r["artifact"] == "fuse" for r in runs),
                      "finished_new": sum(r["artifact"] == "quant" for r in runs),
                      "runs_detail": runs}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
