"""The rows of the GPU suite: what each runs, its time limit, where its JSON comes from.

A row is one or two jobs (the peer first, where the row has one); a job is one subprocess of the
current interpreter. Every figure is JSON the job's command prints (its log's last JSON line) or
writes (a file under OUT): `llmc bench --json`, the peer's line, scripts/gpu_runtime_check.py,
scripts/gpu_serve_bench.py, scripts/gpu_heal_throughput.py, scripts/gpu_heal_sampling.py and the
kernel benches. The suite times nothing but each job's wall.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmaccel.errors import LlmaccelError

PROMPT, GEN = 128, 256          # every goal row: 128-token random prompts, 256 new tokens
SMALL_PROMPT, SMALL_GEN, SMALL_BATCH = 8, 4, 4
SMALL_SRC = "preset:tiny-llama"
SAMPLED = ["--temperature", "0.8", "--top-p", "0.95"]
SPEC_PROMPT = ("Photosynthesis is the process by which green plants turn light into chemical energy. "
               "In this essay I will explain how it works, step by step, and why it matters for life on Earth.")


@dataclass(frozen=True)
class Options:
    """What the command line chose that the rows depend on."""
    device: str = "cuda"
    small: bool = False
    peers: Path | None = None       # folder holding peer_fast.py; None: peers skipped
    peer_skip: str = "no peer folder"
    gguf: Path | None = None        # the real SmolLM2-135M GGUF for the speculative rows
    out: Path = Path("out/suite")   # where results and logs go


@dataclass(frozen=True)
class Job:
    row: str
    label: str                      # the record's name (also the log's: OUT/<label>.log)
    argv: tuple[str, ...]           # arguments after the interpreter
    limit_s: int
    result: str | None = None       # file under OUT holding the JSON; None: the log's last JSON line
    skip: str | None = None         # why it does not run
    serve: bool = False             # needs the serve extra (fastapi, uvicorn, ...)
    json: bool = True               # False: no figures; the exit status and the log's last line


def _bench(o: Options, row: str, label: str, shape: str, batch: int, limit: int, *extra: str,
           src: str | None = None) -> Job:
    """`llmc bench` through LLM, the path users run (bf16 on CUDA, float32 on the CPU)."""
    small = o.small
    argv = ["-m", "llmaccel.bench", SMALL_SRC if small else (src or f"preset:{shape}"),
            "--batch", str(min(batch, SMALL_BATCH) if small else batch),
            "--prompt-len", str(SMALL_PROMPT if small else PROMPT), "--gen-len", str(SMALL_GEN if small else GEN),
            "--device", o.device, "--dtype", "bfloat16" if o.device == "cuda" else "float32",
            "--json", "--no-bw", *extra]
    if small:
        argv += ["--warmup", "1"]
    return Job(row, label, tuple(argv), limit)


def _peer(o: Options, row: str, shape: str, batch: int) -> Job:
    label = f"fast_{shape}_bs{batch}"
    p, g = (SMALL_PROMPT, SMALL_GEN) if o.small else (PROMPT, GEN)
    skip = None
    if o.peers is None:
        skip = o.peer_skip
    elif o.device != "cuda":
        skip = "peer_fast.py runs on CUDA only"
    argv = (str((o.peers or Path(".bench")) / "peer_fast.py"), "--shape", shape, "--batch", str(batch),
            "--prompt", str(p), "--gen", str(g))
    return Job(row, label, argv, 150, skip=skip)


def _goal(shape: str, batch: int, label: str, limit: int, *extra: str, peer: bool = True):
    def build(o: Options, row: str) -> list[Job]:
        jobs = [_peer(o, row, shape, batch)] if peer else []
        return jobs + [_bench(o, row, label, shape, batch, limit, *extra)]
    return build


def _script(label: str, script: str, limit: int, args: list[str], result: str, *,
            small_args: list[str] | None = None, serve: bool = False, out_arg: bool = True):
    """A Python script of scripts/ that writes its JSON to OUT/result (given as --out, or, with
    out_arg False, the name it writes under $OUT). small_args (in place of args with --small) say
    it runs on any device (it is given --device); without, it needs CUDA."""
    def build(o: Options, row: str) -> list[Job]:
        a = list(small_args if o.small and small_args is not None else args)
        a += ["--out", str(o.out / result)] if out_arg else []
        if small_args is not None:
            a += ["--device", o.device]
        skip = "needs CUDA (--device cuda)" if small_args is None and o.device != "cuda" else None
        return [Job(row, label, (f"scripts/{script}", *a), limit, result=result, skip=skip, serve=serve)]
    return build


def _pytest_cuda(o: Options, row: str) -> list[Job]:
    skip = "needs CUDA (--device cuda)" if o.device != "cuda" else None
    argv = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests", "-x", "-k", "not real")
    # the CUDA tests compile and capture many shapes: over 420 s on an H200 (2026-12-02; the two
    # engine tests alone 158 s, 2026-12-03)
    return [Job(row, "cuda_tests", argv, 540, skip=skip, json=False)]


def _spec(draft: str | None):
    """LLM on the real SmolLM2-135M with one draft (or none), the same prompt and the same graph
    (no passes); --small: a tiny preset with random tokens."""
    def build(o: Options, row: str) -> list[Job]:
        label = "spec_" + (draft or "none").replace(":", "")
        extra = ["--no-profile", "--passes", ""] + (["--speculative", draft] if draft else [])
        if o.small:
            return [_bench(o, row, label, "", 1, 120, *extra)]
        if o.gguf is None or not o.gguf.exists():
            why = "needs --gguf (the real SmolLM2-135M GGUF)" if o.gguf is None else f"no file {o.gguf}"
            return [Job(row, label, (), 120, skip=why)]
        return [_bench(o, row, label, "", 1, 120, "--prompt", SPEC_PROMPT, *extra, src=str(o.gguf))]
    return build


def _sla_llm(o: Options, row: str) -> list[Job]:
    """LLM over sla with a window of 64 and 4 sinks (a recurrent state per sequence, decode steps
    on the decode runner) beside the source at the same shape and batch: decode from a constant
    state against attention over the KV cache (speed only: preset weights, the sla fit on the
    bench's own text)."""
    sla = ["--passes", "sla,fuse", "--set", "sla.window=64", "--set", "sla.sinks=4", "--no-profile"]
    return [_bench(o, row, "llmc_smollm2-135m_bs8", "smollm2-135m", 8, 200, "--no-profile"),
            _bench(o, row, "llmc_smollm2-135m-sla-w64_bs8", "smollm2-135m", 8, 300, *sla)]


def _w4(group: int) -> list[str]:
    """The LM head in int4 too (its own copy of the tied embedding), as in the goal's figure."""
    return ["--passes", "fuse,quant", "--set", "quant.bits=4", "--set", f"quant.group_size={group}",
            "--set", "quant.method=rtn", "--set", "quant.lm_head=true"]


def _w8() -> list[str]:
    """int8 per output channel, the LM head too."""
    return ["--passes", "fuse,quant", "--set", "quant.bits=8", "--set", "quant.method=rtn",
            "--set", "quant.lm_head=true"]


def _w4_compile(o: Options, row: str) -> list[Job]:
    """`llmc compile SRC --passes quant` with its defaults (4 bits, awq+gptq, 128 calibration
    windows of wikitext2's first half; a preset reads the text as bytes: the time does not depend
    on the weights), on the suite's device; its report.json holds the pass's seconds."""
    argv = ("-m", "llmaccel.cli", "compile", SMALL_SRC if o.small else "preset:smollm2-135m",
            "--device", o.device, "--passes", "quant", "--calib", "llmaccel/data/wikitext2/wiki.test.raw",
            "--calib-split", "first-half", "--eval-tokens", "0", "-o", str(o.out / "w4_compile"), "--force")
    return [Job(row, "compile_w4_smollm2-135m", argv, 240, result="w4_compile/report.json")]


ROWS = {
    "b1": _goal("llama-1b", 1, "llmc_llama-1b_bs1", 240),
    "b1s": _goal("llama-1b", 1, "llmc_llama-1b_bs1_sampled", 200, *SAMPLED, peer=False),
    "smol": _goal("smollm2-135m", 1, "llmc_smollm2-135m_bs1", 200),
    "smols": _goal("smollm2-135m", 1, "llmc_smollm2-135m_bs1_sampled", 200, *SAMPLED, peer=False),
    "b64": _goal("llama-1b", 64, "llmc_llama-1b_bs64", 240),
    "b64s": _goal("llama-1b", 64, "llmc_llama-1b_bs64_sampled", 200, *SAMPLED, peer=False),
    "w4": lambda o, row: [_bench(o, row, "llmc_llama-1b-int4_bs1", "llama-1b", 1, 240,
                                 *_w4(32 if o.small else 128))],
    "w8": lambda o, row: [_bench(o, row, "llmc_llama-1b-int8_bs1", "llama-1b", 1, 240, *_w8())],
    "7b": _goal("llama2-7b", 1, "llmc_llama2-7b_bs1", 240),
    "load": _script("load_llama-1b_256", "gpu_runtime_check.py", 300, ["--load-only", "--graphs", "on"],
                    "gpu_runtime_check.json", small_args=["--load-only", "--graphs", "off", "--small", "--requests", "8"]),
    "serve": _script("serve_llama-1b_256", "gpu_serve_bench.py", 400, [], "serve.json",
                     small_args=["--small", "--src", SMALL_SRC, "--requests", "8"], serve=True),
    "kernels": _script("runtime_kernels", "gpu_runtime_check.py", 200, ["--no-load"],
                       "gpu_runtime_kernels.json"),
    "tests": _pytest_cuda,
    "gemv": _script("gemv_int4", "gpu_quant_bench.py", 150, ["--batches", "1", "--budget", "90", "--ops", "int4"],
                    "quant_bench.json", out_arg=False),
    "bitlinear": _script("bitlinear", "gpu_bitlinear_bench.py", 90, ["--batch", "1", "16"],
                         "bitlinear_bench.json", out_arg=False),
    "sla": _script("sla", "gpu_sla_bench.py", 90, [], "sla_bench.json", out_arg=False),
    "sparse": _script("sparse_down", "gpu_sparse_bench.py", 60, [], "sparse_down_bench.json", out_arg=False),
    "heal": _script("heal_throughput", "gpu_heal_throughput.py", 300, [], "heal_throughput.json",
                    small_args=["--small"]),
    "w4compile": _w4_compile,
    "heal_sampling": _script("heal_sampling", "gpu_heal_sampling.py", 200,
                             ["--model", "preset:smollm2-135m"], "heal_sampling.json",
                             small_args=["--model", SMALL_SRC, "--windows", "8", "--length", "65",
                                         "--dtype", "float32"]),
    "sla_llm": _sla_llm,
    "spec": _spec(None),
    "spec_self": _spec("self"),
    "spec_ngram": _spec("ngram"),
}
GROUPS = {
    "goals": ["b1", "b1s", "smol", "smols", "b64", "b64s", "w4", "w8", "7b", "load"],
    "checks": ["tests", "kernels", "gemv", "bitlinear", "sla", "sla_llm", "sparse", "heal", "heal_sampling",
               "w4compile"],
    "specs": ["spec", "spec_self", "spec_ngram"],
}
GROUPS["all"] = GROUPS["goals"] + ["serve"] + GROUPS["checks"] + GROUPS["specs"]
DEFAULT_ROWS = GROUPS["goals"]


def expand(names: list[str]) -> list[str]:
    """Row names in the order given, groups expanded, each once."""
    out: list[str] = []
    for n in names:
        for r in GROUPS.get(n, [n]):
            if r not in ROWS:
                raise LlmaccelError(f"unknown row {r!r} (rows: {' '.join(ROWS)}; groups: {' '.join(GROUPS)})")
            if r not in out:
                out.append(r)
    return out


def plan(names: list[str], o: Options) -> list[Job]:
    """The jobs of the rows named, in order."""
    return [job for r in expand(names) for job in ROWS[r](o, r)]
