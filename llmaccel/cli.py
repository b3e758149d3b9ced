"""llmc: the command line. User errors print one line and exit with code 2 (--debug: traceback)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from llmaccel.errors import LlmaccelError, require_extra


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="smollm2-135m | preset:NAME | HF dir | .gguf | artifact dir")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on the CPU; "
                                                   "as LLM and bench) | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto (cuda when present) | cuda | cpu")


def _resolve_device(a) -> None:
    """--device / --dtype auto, the same defaults as LLM() and llmc bench; a device this
    machine lacks is refused here, before any model is read."""
    from llmaccel.compiler.model import resolve_device

    if getattr(a, "device", None) is not None:
        a.device = resolve_device(a.device)
    if getattr(a, "dtype", None) == "auto":
        a.dtype = "bfloat16" if str(a.device).startswith("cuda") else "float32"


def check_model_flag(value: str | None, flag: str) -> None:
    """A model named by a flag other than SRC (--baseline): a typo is refused under the flag's
    name before any model loads."""
    from llmaccel.compiler.sources import names_a_source, sources_hint

    if value is not None and not names_a_source(value):
        raise LlmaccelError(f"{flag}: unknown model {value!r}; {sources_hint()}")


def cmd_compile(a) -> None:
    from llmaccel.compiler.artifact import check_output
    from llmaccel.compiler.pipeline import compile
    from llmaccel.compiler.report import render_markdown
    from llmaccel.passes.base import parse_sets

    check_output(a.output, a.force, "--force")  # before minutes of compiling, not after
    check_model_flag(a.baseline, "--baseline")
    if a.eval_tokens is not None and a.eval_tokens < 0:
        raise LlmaccelError(f"--eval-tokens must be >= 0, got {a.eval_tokens}")
    from llmaccel.runtime.windows import sample_windows

    model = compile(a.src, a.passes or "", parse_sets(a.set), calib=a.calib, calib_split=a.calib_split,
                    verify=a.verify, eval_tokens=a.eval_tokens, dtype=a.dtype, device=a.device,
                    sampler=sample_windows, baseline=a.baseline, eval_ctx=a.eval_ctx)
    model.save(a.output, model.report, force=a.force)
    print(render_markdown(model.report))
    print(f"wrote {a.output}")


def _load(src: str, a):
    """A compiled model, or an exported ONNX folder run through onnxruntime."""
    from llmaccel.compiler.model import load
    from llmaccel.export.folder import is_export_dir

    if is_export_dir(src):
        from llmaccel.export.runtime import OnnxModel

        return OnnxModel(src)
    return load(src, dtype=a.dtype, device=a.device)


def _eval_text(text: str, split: str | None) -> tuple[str, str]:
    """(path or 'self', split) for `--text` / `--split`: a bundled text's name reads its file in
    the package, by default the part no pass calibrates on."""
    from llmaccel.eval.domains import DATA_DIR, DOMAINS

    if text in DOMAINS:
        rel, own = DOMAINS[text]
        return str(DATA_DIR / rel), split or own
    return text, split or "all"


def cmd_eval(a) -> None:
    from llmaccel.eval.perplexity import evaluate
    from llmaccel.eval.text import load_tokens

    if a.ctx < 1:
        raise LlmaccelError(f"--ctx must be positive, got {a.ctx}")
    if a.max_tokens is not None and a.max_tokens < 2:
        raise LlmaccelError(f"--max-tokens must be at least 2 (one token and its successor), "
                            f"got {a.max_tokens}")
    check_model_flag(a.baseline, "--baseline")
    model = _load(a.src, a)
    baseline = _load(a.baseline, a) if a.baseline else None
    if baseline is not None and baseline.config.vocab_size != model.config.vocab_size:
        raise LlmaccelError(f"baseline vocabulary ({baseline.config.vocab_size}) differs from the "
                            f"model's ({model.config.vocab_size})")
    text, split = _eval_text(a.text, a.split)
    ids = load_tokens(baseline or model, text, split, a.max_tokens, ctx=a.ctx, progress=True)
    res = evaluate(model, ids, ctx=a.ctx, baseline=baseline, chunk=a.chunk)
    res["text"] = text if text == "self" else f"{a.text} ({split})"
    line = f"ppl {res['ppl']:.4f} over {res['tokens']} tokens ({res['windows']} windows of {a.ctx})"
    if res["chunk"] is not None:
        line += f", prefilled in chunks of {res['chunk']} through the KV cache"
    if baseline is not None:
        line += f"; KL {res['kl']:.6f}, top-1 {100 * res['top1']:.2f}% vs {a.baseline}"
    print(line)
    if a.json:
        print(json.dumps(res))


CPU_COMPILE_TOKENS = 512  # llmc generate compiles a CPU decode step from this many new tokens on


def cmd_generate(a) -> None:
    from llmaccel.compiler.sources import check_draft
    from llmaccel.runtime.engine import LLM
    from llmaccel.sampling import SamplingParams

    if a.max_new_tokens < 1:  # the API's max_tokens=0 (no output) is no use on the command line
        raise LlmaccelError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                            max_tokens=a.max_new_tokens, seed=a.seed, ignore_eos=a.ignore_eos,
                            stop=a.stop or None)
    if a.num_speculative_tokens < 1:
        raise LlmaccelError(f"--num-speculative-tokens must be >= 1, got {a.num_speculative_tokens}")
    check_draft(a.speculative)
    if a.tp < 1:
        raise LlmaccelError(f"--tp must be >= 1, got {a.tp}")
    # the ranks of --tp N load the source themselves (tp_ranks.py)
    model = _load(a.src, a) if a.tp == 1 else None
    # An exported folder generates through onnxruntime; anything else through the engine.
    onnx = model is not None and model.gm is None
    if onnx and (a.speculative or a.stats):
        raise LlmaccelError("an exported ONNX folder generates without --speculative and --stats")
    # on a CPU, compiling the decode step costs 6-40 s (tracing; Inductor's cache keeps the C++)
    # and saves 9-26 ms a token on SmolLM2-135M: worth it from a few hundred tokens on
    short_cpu = str(a.device) == "cpu" and a.max_new_tokens < CPU_COMPILE_TOKENS
    llm = model if onnx else LLM(model or a.src, dtype=a.dtype, device=a.device, speculative=a.speculative,
                                 num_speculative_tokens=a.num_speculative_tokens, tensor_parallel_size=a.tp,
                                 compile=False if short_cpu else None)
    model = model or llm.model
    prompt = model.encode(a.prompt, chat=True) if a.chat else a.prompt
    t0, first = time.perf_counter(), None
    for piece in llm.stream(prompt, params):
        first = first or time.perf_counter()
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if a.stats:
        wall = time.perf_counter() - t0
        m = llm.metrics()
        n = m["generated_tokens"]
        # wall time of the whole request (load and compile excluded), first text included
        m.update(wall_s=round(wall, 4), tok_s=round(n / wall, 2) if wall > 0 else None,
                 first_text_s=round(first - t0, 4) if first else None)
        print(f"{n} tokens in {wall:.3f} s: {n / wall:.1f} tok/s", file=sys.stderr)
        print(json.dumps(m), file=sys.stderr)
    if a.tp > 1:
        llm.close()


def cmd_export(a) -> None:
    require_extra("onnx", "onnx", "llmc export")
    from llmaccel.compiler.model import load
    from llmaccel.export.exporter import check_export_output, export

    check_export_output(a.output, a.force, "--force")  # before loading the model, not after
    # Read in fp32 on the CPU; the weights are cast to the export dtype as they are written.
    out = export(load(a.src, dtype="float32", device="cpu"), a.output, fmt=a.format, dtype=a.dtype,
                 force=a.force)
    print(f"wrote {out} ({a.format}, {a.dtype})")


def cmd_show(a) -> None:
    from llmaccel.compiler.pipeline import compile
    from llmaccel.passes.base import parse_sets

    model = compile(a.src, a.passes or "", parse_sets(a.set), dtype=a.dtype, device=a.device,
                    eval_tokens=0, progress=False)
    c = model.config
    print(f"{a.src}: family {c.family} ({c.model_type}), {c.n_layers} layers, hidden {c.hidden_size}, "
          f"heads {c.n_heads}/{c.n_kv_heads} kv, head_dim {c.head_dim}, vocab {c.vocab_size}")
    n_params = sum(p.numel() for p in model.gm.parameters())
    print(f"weights: {n_params:,} elements")
    print("\nop counts:")
    for op, n in model.op_counts().items():
        print(f"  {op:<20} {n}")
    if not a.counts_only:
        print("\ngraph:")
        print(model.gm.graph)


def cmd_passes(a) -> None:
    from llmaccel.compiler.registry import registry
    from llmaccel.passes.base import describe_type, option_fields

    for name, cls in registry().items():
        print(f"{name:<10} {'exact' if cls.exact else 'approximate':<12} {cls.summary}")
        if cls.before:
            print(f"    runs before: {', '.join(cls.before)}")
        for key, (tp, default) in option_fields(cls.config_cls).items():
            print(f"    {name}.{key}: {describe_type(tp)} = {default}")
    if a.all:
        from llmaccel.codegen.lower import LOWERING

        print("\nlowering (after the passes, where the graph runs; `llmc compile --verify` checks "
              "custom-ops, rope-tables, rows and gemv):")
        for name, what in LOWERING.items():
            print(f"{name:<14} {what}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="llmc", description="llmaccel: LLM inference compiler and runtime")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _compile_parser(sub)
    _eval_parser(sub)
    _generate_parser(sub)
    _other_parsers(sub)

    from llmaccel.bench.cli import add_parser as add_bench
    from llmaccel.serve.cli import add_parser as add_serve

    add_bench(sub)
    add_serve(sub)
    return ap


def _compile_parser(sub) -> None:
    p = sub.add_parser("compile", help="run passes and write an artifact directory")
    _model_args(p)
    p.add_argument("--passes", default="", help="comma-separated pass names, run in order")
    p.add_argument("--set", action="append", default=[], metavar="PASS.KEY=VALUE")
    p.add_argument("--calib", default="mixed",
                   help="calibration text: 'mixed' (bundled prose, Python code and docs, none of it "
                        "evaluated on), a text file (read by --calib-split), or 'self' (samples of the "
                        "source: slow on a CPU)")
    p.add_argument("--calib-split", default="first-half", choices=["first-half", "second-half", "all"])
    p.add_argument("--baseline", default=None, metavar="SRC",
                   help="the model the passes fit to and distil from and the quality check compares "
                        "with (default: src); the original model when src is an artifact to heal further")
    p.add_argument("--verify", action="store_true", help="compare logits before/after each pass")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="held-apart tokens for the quality check (default 4096, at least one window, "
                        "when a pass is approximate)")
    p.add_argument("--eval-ctx", type=int, default=None, metavar="N",
                   help="the quality check's window (default 512): 4096 or 8192 for what acts on long "
                        "contexts (kvquant)")
    p.add_argument("-o", "--output", required=True, help="artifact folder (new, empty, or an "
                                                          "artifact to replace with --force)")
    p.add_argument("--force", action="store_true", help="replace an existing artifact at -o")
    p.set_defaults(fn=cmd_compile)


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, and KL / top-1 against a baseline")
    _model_args(p)
    p.add_argument("--text", default="wikitext2",
                   help="a bundled text (wikitext2, python-code, python-docs), a text file, or 'self' "
                        "(seeded samples of the baseline or model: slow on a CPU)")
    p.add_argument("--split", default=None, choices=["first-half", "second-half", "all"],
                   help="default: a bundled text's evaluation part (wikitext2's second half), else all")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--baseline", default=None)
    p.add_argument("--chunk", type=int, default=None,
                   help="prefill each window N tokens at a time through the KV cache "
                        "(default: 32 for a quantized KV cache, else one forward)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(fn=cmd_eval)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a continuation of a prompt")
    _model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--speculative", default=None, metavar="self|self:int4|ngram|SRC",
                   help="speculative decoding: an int8 copy of the target (self; self:int4 an int4 "
                        "one), prompt lookup (ngram), or a draft model with the same tokenizer")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks (one GPU each; CPU processes over gloo without a GPU)")
    p.add_argument("--stats", action="store_true", help="print runtime metrics (JSON) to stderr")
    p.set_defaults(fn=cmd_generate, flags={"max_tokens": "--max-new-tokens", "temperature": "--temperature",
                                          "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
                                          "stop": "--stop"})


def _other_parsers(sub) -> None:
    """export, show, passes."""
    p = sub.add_parser("export", help="write an ONNX folder for ONNX Runtime (GenAI)")
    _model_args(p)
    p.add_argument("--format", default="genai", choices=["genai", "onnx"],
                   help="genai: contrib ops and genai_config.json; onnx: the standard opset only")
    p.add_argument("-o", "--output", required=True, help="export folder (new, empty, or an "
                                                          "export to replace with --force)")
    p.add_argument("--force", action="store_true", help="replace an existing export at -o")
    p.set_defaults(fn=cmd_export, dtype="float32", device="cpu")

    p = sub.add_parser("show", help="print the IR: op counts and the graph")
    _model_args(p)
    p.add_argument("--passes", default="")
    p.add_argument("--set", action="append", default=[], metavar="PASS.KEY=VALUE")
    p.add_argument("--counts-only", action="store_true")
    p.set_defaults(fn=cmd_show)

    p = sub.add_parser("passes", help="list passes and their options")
    p.add_argument("--all", action="store_true", help="also the lowering rewrites that follow the passes")
    p.set_defaults(fn=cmd_passes)


def _as_flags(msg: str, flags: dict[str, str]) -> str:
    """An API message that starts with a field name ('max_tokens must be ...') names the flag
    the user typed instead ('--max-new-tokens must be ...')."""
    first, sep, rest = msg.partition(" ")
    return flags[first] + sep + rest if first in flags else msg


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        _resolve_device(a)
        a.fn(a)
    except LlmaccelError as e:
        if a.debug:
            raise
        flags = {"device": "--device", **getattr(a, "flags", {})}
        print(f"llmc: error: {_as_flags(str(e), flags)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmc: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
