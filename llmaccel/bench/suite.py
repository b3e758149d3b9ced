"""The GPU suite: every speed goal of `LLM` next to the fast peer, the serving load and server,
the kernel checks and benches, in one call under one deadline.

    PYTHONPATH=$PWD python -m llmaccel.bench.suite [--rows goals serve ...] [--out DIR]
    python -m llmaccel.bench.suite --device cpu --small --out DIR     # the suite itself, on a CPU

Each job is a subprocess of this interpreter with its own time limit (capped by the time left
before --deadline; one that would start with under a minute left is skipped). One JSON line per
job goes to OUT/suite.jsonl (failures and skips too, with the error and the log's tail), each
job's full output to OUT/<label>.log, and a table with ratios to the peer and the goals is
printed last. Rows and groups: suite_rows.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmaccel.bench.suite_rows import DEFAULT_ROWS, GROUPS, ROWS, Job, Options, plan
from llmaccel.bench.suite_table import table
from llmaccel.errors import LlmaccelError

ROOT = Path(__file__).resolve().parents[2]      # the checkout: scripts/ and .bench/ live here
MIN_LEFT_S = 60                                 # a job starting with less time left is skipped
SERVE_DEPS = ["fastapi", "uvicorn", "httptools", "uvloop", "prometheus-client", "httpx", "aiohttp"]
TAIL_LINES = 12


def last_json(text: str) -> dict | None:
    """The last line of `text` that parses as a JSON object."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict):
                return d
    return None


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-TAIL_LINES:])[-2000:]


def _read_json(path: Path | None) -> dict | None:
    try:
        d = json.loads(path.read_text()) if path is not None and path.exists() else None
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def _call(argv: list[str], log, env: dict[str, str], timeout: float) -> int | None:
    """Exit status of argv, or None when it ran past `timeout`: then its whole process group is
    ended (a row's own children, such as the server the serve row starts, must not outlive it)."""
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        return p.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
            try:
                os.killpg(p.pid, sig)
                p.wait(timeout=wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        return None


def run_job(job: Job, out: Path, limit_s: float, env: dict[str, str], pre: list[list[str]] = ()) -> dict:
    """Run one job (after the commands in `pre`, which share its log and limit); its record."""
    log = out / f"{job.label}.log"
    result = out / job.result if job.result else None
    if result is not None and result.exists():
        result.unlink()  # a figure left from an earlier run must not pass for this one's
    rec = {"row": job.row, "label": job.label, "limit_s": round(limit_s)}
    t0 = time.monotonic()
    rc = 0
    with open(log, "w") as f:
        for argv in [*pre, [sys.executable, *job.argv]]:
            f.write("$ " + shlex.join(argv) + "\n")
            f.flush()
            rc = _call(argv, f, env, limit_s - (time.monotonic() - t0))
            if rc != 0:
                break
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    text = log.read_text(errors="replace")
    if rc == 0 and not job.json:
        return {**rec, "status": "ok", "summary": next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")}
    data = _read_json(result) if result is not None else last_json(text)
    if rc == 0 and data is not None:
        return {**rec, "status": "ok", "result": data,
                **({"summary": f"ok, JSON in {result.name}"} if result is not None else {})}
    why = (f"time limit ({limit_s:.0f} s)" if rc is None else f"exit code {rc}" if rc
           else f"no JSON in {result.name if result else 'the log'}")
    rec.update(status="failed", error=why, tail=_tail(text))
    if data is not None:  # a check failed after the figures were written: keep them
        rec["result"] = data
    return rec


def serve_setup(wheels: Path | None, deps: Path) -> tuple[list[list[str]], str | None, str | None]:
    """How the serve row gets its extra: (commands to run first, a PYTHONPATH entry, why it cannot)."""
    if importlib.util.find_spec("fastapi") is not None:
        return [], None, None
    if wheels is None:
        return [], None, "fastapi is not importable: give --wheels DIR (docs/serving.md lists the wheels)"
    if not wheels.is_dir():
        return [], None, f"no wheel folder {wheels}"
    if (deps / "fastapi").is_dir():  # installed by an earlier run on this machine
        return [], str(deps), None
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
           "--target", str(deps), *SERVE_DEPS]
    return [cmd], str(deps), None


def run_suite(jobs: list[Job], out: Path, deadline_s: float, *, wheels: Path | None = None,
              deps: Path | None = None, min_left_s: float = MIN_LEFT_S, echo=print,
              clock=time.monotonic) -> list[dict]:
    """Run the jobs in order under one deadline; append each record to OUT/suite.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "suite.jsonl"
    path.write_text("")
    base = dict(os.environ)
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [base.get("PYTHONPATH")])])
    base["OUT"] = str(out)
    t0 = clock()
    records = []
    for job in jobs:
        left = deadline_s - (clock() - t0)
        env, pre, skip = base, [], job.skip
        if skip is None and job.serve:
            pre, extra, skip = serve_setup(wheels, deps or Path(tempfile.gettempdir(), "deps"))
            if extra:
                env = {**base, "PYTHONPATH": os.pathsep.join([extra, base["PYTHONPATH"]])}
        if skip is None and left < min_left_s:
            skip = f"out of time ({left:.0f} s left of {deadline_s:.0f})"
        if skip is not None:
            rec = {"row": job.row, "label": job.label, "status": "skipped", "reason": skip}
            echo(f"== {job.label}: skipped ({skip})")
        else:
            limit = min(job.limit_s, left)
            echo(f"== {job.label} (limit {limit:.0f} s): {shlex.join(job.argv)}")
            rec = run_job(job, out, limit, env, pre)
            echo(f"   {rec['status']} after {rec['wall_s']} s" + (f": {rec['error']}" if "error" in rec else ""))
        records.append(rec)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return records


def describe_machine(device: str) -> str:
    """One line naming what the figures were measured on; refuses --device cuda without CUDA."""
    import platform

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise LlmaccelError("no CUDA device here: --device cpu --small checks the suite on a CPU")
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    return f"{name}; Python {platform.python_version()}, torch {torch.__version__}"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m llmaccel.bench.suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, metavar="ROW",
                    help=f"rows or groups, in order (rows: {' '.join(ROWS)}; groups: "
                         + "; ".join(f"{g} = {' '.join(r)}" for g, r in GROUPS.items() if g != "all")
                         + "; all); default: goals")
    ap.add_argument("--out", type=Path, default=Path("out/suite"), help="results and logs (default out/suite)")
    ap.add_argument("--deadline", type=float, default=560, help="seconds for the whole run (default 560)")
    ap.add_argument("--peers", type=Path, default=ROOT / ".bench",
                    help="folder with peer_fast.py (a copy of ../shared/bench; default .bench)")
    ap.add_argument("--no-peer", action="store_true", help="skip the peers")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true",
                    help="tiny shapes (preset:tiny-llama, a few tokens): checks the suite itself")
    ap.add_argument("--gguf", type=Path, default=None, help="the real SmolLM2-135M GGUF (rows spec*)")
    ap.add_argument("--wheels", type=Path, default=None,
                    help="wheels of the serve extra, installed for the serve row when fastapi is missing")
    return ap.parse_args(argv)


def options(a: argparse.Namespace) -> Options:
    peers, why = a.peers, None
    if a.no_peer:
        peers, why = None, "--no-peer"
    elif not (a.peers / "peer_fast.py").is_file():
        peers, why = None, f"no {a.peers / 'peer_fast.py'} (copy ../shared/bench there)"
    return Options(device=a.device, small=a.small, peers=peers and peers.resolve(), peer_skip=why or "",
                   gguf=a.gguf and a.gguf.resolve(), out=a.out.resolve())


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        if a.deadline <= 0:
            raise LlmaccelError(f"--deadline must be positive (got {a.deadline})")
        jobs = plan(a.rows, options(a))
        print(describe_machine(a.device))
    except LlmaccelError as e:
        print(f"suite: error: {e}", file=sys.stderr)
        return 2
    out = a.out.resolve()
    records = run_suite(jobs, out, a.deadline, wheels=a.wheels and a.wheels.resolve())
    print()
    print(table(records))
    print(f"\n{len(records)} records in {out / 'suite.jsonl'}")
    return 0 if all(r["status"] != "failed" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
