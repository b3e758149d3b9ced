"""Fuzz the model-file loaders: mutated GGUF (the real SmolLM2 GGUF and a small one written by
the gguf package), safetensors (an HF checkpoint of preset:tiny-llama, the SmolLM2 cache) and
artifact manifests, each case loaded in a worker process under a 5 s limit.

    PYTHONPATH=. python scripts/fuzz_loaders.py --cases 2100 [--seed 0] [--cli 20]

Every case must end in 'ok' (the file loads) or 'error' (one LlmaccelError line); a traceback,
a case over the limit (a hang) or a dead worker (a crash) is a failure, printed with its seed so
that it can be replayed. --cli N also runs N mutated artifacts through `llmc show` in a fresh
process and checks one line on stderr and exit code 0 or 2. Exit code 1 when anything failed.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "compiler")]

import fuzz_targets as F  # noqa: E402

LIMIT_S = 5.0
KINDS = ("gguf-small", "gguf-real", "safetensors-hf", "safetensors-real", "manifest")


class Seeds:
    """The unmutated files, built once per run in `work`."""

    def __init__(self, work: Path):
        from llmaccel.compiler.filecheck import check_gguf
        from llmaccel.compiler.sources import cache_dir

        self.work = work
        self.gguf_small = F.tiny_gguf(work / "small.gguf").read_bytes()
        real = F.real_gguf()
        self.real_size = real.stat().st_size
        self.real_hot = check_gguf(real)["data_offset"]
        with open(real, "rb") as f:
            self.gguf_real = f.read(self.real_hot)
        self.hf = F.tiny_hf_dir(work / "hf")
        self.hf_st = (self.hf / "model.safetensors").read_bytes()
        st = cache_dir() / "smollm2-135m" / "model.safetensors"
        self.real_st = None
        if st.is_file():
            with open(st, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                f.seek(0)
                self.real_st = (f.read(8 + n), st.stat().st_size)
        self.art = F.tiny_artifact(work / "art")
        self.manifest = (self.art / "manifest.json").read_bytes()


def make_case(seeds: Seeds, kind: str, case: int, seed: int, out: Path) -> tuple[Path, str]:
    """Writes the mutated file for (kind, case); returns it and the target to load it with."""
    rng = random.Random(f"{seed}:{kind}:{case}")
    if kind == "gguf-small":
        p = out / "m.gguf"
        p.write_bytes(F.mutate(seeds.gguf_small, rng, F.header_end(seeds.gguf_small, "gguf")))
        return p, "gguf"
    if kind == "gguf-real":
        # the mutated metadata, then the tensor data as a sparse run of zeros of the real length
        p = out / "m.gguf"
        head = F.mutate(seeds.gguf_real, rng, len(seeds.gguf_real))
        with open(p, "wb") as f:
            f.write(head)
            f.truncate(len(head) + seeds.real_size - len(seeds.gguf_real))
        return p, "gguf-header"
    if kind == "safetensors-hf":
        d = out / "hf"
        if not d.exists():
            F.copy_folder(seeds.hf, d)
        data = seeds.hf_st
        (d / "model.safetensors").write_bytes(F.mutate(data, rng, F.header_end(data, "safetensors")))
        return d, "hf"
    if kind == "safetensors-real":
        head, size = seeds.real_st
        p = out / "m.safetensors"
        mut = F.mutate(head, rng, len(head))
        with open(p, "wb") as f:
            f.write(mut)
            f.truncate(len(mut) + size - len(head))
        return p, "safetensors"
    d = out / "art"
    if not d.exists():
        F.copy_folder(seeds.art, d)
    (d / "manifest.json").write_bytes(F.mutate_manifest(seeds.manifest, rng))
    return d, "artifact"


TARGETS = {"gguf": F.load_gguf, "gguf-header": lambda p: F.load_gguf(p, reader=False),
           "hf": F.load_hf, "safetensors": F.load_safetensors_file, "artifact": F.load_artifact}


def worker(conn, work: str, seed: int) -> None:
    seeds = Seeds(Path(work))
    out = Path(tempfile.mkdtemp(dir=work))
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        kind, case = job
        t0 = time.perf_counter()
        try:
            path, target = make_case(seeds, kind, case, seed, out)
            t1 = time.perf_counter()
            res, detail = TARGETS[target](path), ""
        except Exception as e:  # a traceback: the defect this script looks for
            t1 = t1 if "t1" in locals() else t0
            res, detail = "traceback", "".join(traceback.format_exception_only(e)).strip()[:300]
        conn.send((res, time.perf_counter() - t1, detail))


class Pool:
    """One worker process; restarted after a hang or a crash."""

    def __init__(self, work: Path, seed: int):
        self.work, self.seed, self.proc = work, seed, None

    def start(self) -> None:
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(child, str(self.work), self.seed), daemon=True)
        self.proc.start()
        if not self.conn.poll(600) or self.conn.recv() != "ready":
            raise SystemExit("fuzz worker did not start")

    def run(self, kind: str, case: int) -> tuple[str, float, str]:
        if self.proc is None or not self.proc.is_alive():
            self.start()
        self.conn.send((kind, case))
        # the file is written before the clock starts; the limit is on loading it
        if self.conn.poll(LIMIT_S + 30):
            try:
                return self.conn.recv()
            except EOFError:
                pass
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
            return "hang", LIMIT_S + 30, ""
        self.proc.join()
        return "crash", 0.0, f"worker exit code {self.proc.exitcode}"

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(10)


def cli_cases(seeds_dir: Path, n: int, seed: int) -> list[dict]:
    """Mutated artifacts through `llmc show` in a fresh process: one line, exit 0 or 2."""
    out = []
    art = seeds_dir / "art"
    for i in range(n):
        d = F.copy_folder(art, seeds_dir / "cli-art")
        rng = random.Random(f"{seed}:cli:{i}")
        if rng.random() < 0.5:
            (d / "manifest.json").write_bytes(F.mutate_manifest((art / "manifest.json").read_bytes(), rng))
        else:
            st = (art / "model.safetensors").read_bytes()
            (d / "model.safetensors").write_bytes(F.mutate(st, rng, F.header_end(st, "safetensors")))
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "llmaccel.cli", "show", str(d), "--counts-only"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        ok = r.returncode == 0 or (r.returncode == 2 and len(lines) == 1
                                   and lines[0].startswith("llmc: error:"))
        out.append({"case": i, "rc": r.returncode, "ok": ok, "seconds": time.perf_counter() - t0,
                    "stderr": r.stderr[-300:]})
    return out


ATHERIS_KINDS = ("gguf", "safetensors", "manifest")


def atheris_corpus(work: Path) -> Path:
    """Seed inputs: a kind byte, then a small GGUF, safetensors file or manifest."""
    from safetensors.torch import save_file
    import torch

    d = work / "corpus"
    d.mkdir()
    st = work / "small.safetensors"
    save_file({"a": torch.ones(4, 3), "b": torch.arange(5)}, str(st))
    art = F.tiny_artifact(work / "corpus-art")
    seeds = (F.tiny_gguf(work / "corpus.gguf").read_bytes(), st.read_bytes(),
             (art / "manifest.json").read_bytes())
    for i, data in enumerate(seeds):
        (d / f"seed{i}").write_bytes(bytes([i]) + data)
    return d


def atheris_child(runs: int, corpus: str) -> None:
    """Coverage-guided fuzzing (libFuzzer through atheris) of the header and manifest checks;
    an exception other than LlmaccelError, or an input over 5 s, stops it with exit code != 0."""
    import atheris
    import numpy  # noqa: F401 - imported before instrumentation: only llmaccel is instrumented
    import torch  # noqa: F401

    with atheris.instrument_imports(include=["llmaccel"]):
        from llmaccel.compiler.filecheck import check_bytes
        from llmaccel.compiler.manifest import check_manifest
        from llmaccel.compiler.serialize import graph_from_json
    from llmaccel.errors import LlmaccelError

    def one(data: bytes) -> None:
        if not data:
            return
        kind, body = ATHERIS_KINDS[data[0] % 3], data[1:]
        try:
            if kind == "manifest":
                m = json.loads(body)
                check_manifest(m, "manifest", 1)
                graph_from_json(m["graph"])
            else:
                check_bytes(body, kind)
        except (LlmaccelError, ValueError, RecursionError) as e:
            # json.loads raises ValueError/RecursionError for bad JSON (read_manifest turns them
            # into LlmaccelError); anything from the checks themselves must be an LlmaccelError
            if kind != "manifest" and not isinstance(e, LlmaccelError):
                raise
            if isinstance(e, LlmaccelError) and "\n" in str(e):
                raise AssertionError(f"a message of more than one line: {e}") from None

    atheris.Setup([sys.argv[0], f"-runs={runs}", "-max_len=65536", f"-timeout={int(LIMIT_S)}",
                   "-print_final_stats=1", corpus], one)
    atheris.Fuzz()


def run_atheris(runs: int, work: Path) -> dict:
    corpus = atheris_corpus(work)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--atheris-child", str(runs), str(corpus)],
                       capture_output=True, text=True, cwd=ROOT)
    stats = [ln for ln in r.stderr.splitlines() if ln.startswith(("stat::", "Done"))]
    return {"runs": runs, "rc": r.returncode, "seconds": round(time.perf_counter() - t0, 1),
            "stats": stats, "tail": "" if r.returncode == 0 else r.stderr[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2100, help="mutated files in all, spread over the kinds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cli", type=int, default=0, help="mutated artifacts also run through llmc show")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--atheris", type=int, default=0,
                    help="also run N coverage-guided inputs through atheris (if installed)")
    ap.add_argument("--atheris-child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.atheris_child:
        atheris_child(int(a.atheris_child[0]), a.atheris_child[1])
        return 0
    with tempfile.TemporaryDirectory(prefix="llmc-fuzz-") as work:
        work = Path(work)
        pool = Pool(work, a.seed)
        pool.start()
        from llmaccel.compiler.sources import cache_dir

        # the SmolLM2 safetensors exist once any command has converted its GGUF
        real_st = (cache_dir() / "smollm2-135m" / "model.safetensors").is_file()
        kinds = [k for k in KINDS if k != "safetensors-real" or real_st]
        counts: dict[str, Counter] = {k: Counter() for k in kinds}
        slowest = {k: 0.0 for k in kinds}
        failures = []
        t_start = time.perf_counter()
        for i in range(a.cases):
            kind = kinds[i % len(kinds)]
            res, secs, detail = pool.run(kind, i // len(kinds))
            if secs > LIMIT_S and res in ("ok", "error"):
                res = "slow"
            counts[kind][res] += 1
            slowest[kind] = max(slowest[kind], secs)
            if res not in ("ok", "error"):
                failures.append({"kind": kind, "case": i // len(kinds), "result": res,
                                 "seconds": round(secs, 3), "detail": detail})
                print(f"FAIL {kind} case {i // len(kinds)}: {res} {detail}", file=sys.stderr)
            if (i + 1) % 200 == 0:
                print(f"{i + 1}/{a.cases} cases, {len(failures)} failures, "
                      f"{time.perf_counter() - t_start:.0f} s", file=sys.stderr)
        pool.close()
        cli = cli_cases(work, a.cli, a.seed) if a.cli else []
        ath = run_atheris(a.atheris, work) if a.atheris else None
    summary = {"cases": a.cases, "seed": a.seed, "limit_s": LIMIT_S,
               "by_kind": {k: dict(c) for k, c in counts.items()},
               "slowest_s": {k: round(v, 3) for k, v in slowest.items()},
               "failures": failures, "wall_s": round(time.perf_counter() - t_start, 1),
               "cli": {"cases": len(cli), "bad": [c for c in cli if not c["ok"]],
                       "slowest_s": round(max((c["seconds"] for c in cli), default=0), 2),
                       "rc": dict(Counter(c["rc"] for c in cli))},
               "atheris": ath}
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 1 if failures or summary["cli"]["bad"] or (ath and ath["rc"]) else 0


if __name__ == "__main__":
    sys.exit(main())
