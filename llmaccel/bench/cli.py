"""Argparse wiring of `llmc bench` (llmaccel/cli.py calls add_parser)."""
from __future__ import annotations

import json

from llmaccel.errors import LlmaccelError


def _bool_or_auto(v: str) -> bool | None:
    return {"auto": None, "on": True, "off": False}[v]


def _lower_select(v: str):
    if v in ("all", "none"):
        return v
    return {s.strip() for s in v.split(",") if s.strip()}


def cmd_bench(a) -> None:
    from llmaccel.bench.run import bench, render
    from llmaccel.passes.base import parse_sets

    res = bench(a.src, batch=a.batch, prompt_len=a.prompt_len, gen_len=a.gen_len, dtype=a.dtype,
                device=a.device, passes=a.passes, options=parse_sets(a.set),
                compile=_bool_or_auto(a.compile), mode=None if a.mode == "none" else a.mode,
                lower_ops=_lower_select(a.lower), linear=a.linear, attn=a.attn, warmup=a.warmup,
                measure_bw=not a.no_bw, tune=a.tune, profile=not a.no_profile,
                speculative=a.speculative, spec_k=a.spec_k, prompt=a.prompt)
    print(render(res))
    if a.json:
        print(json.dumps(res))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="prefill/decode speed, memory and roofline of the decode path")
    p.add_argument("src", help="preset:NAME | smollm2-135m | HF dir | .gguf | artifact dir")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float32 | float16")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--passes", default="fuse", help="passes run before lowering (default: fuse)")
    p.add_argument("--set", action="append", default=[], metavar="PASS.KEY=VALUE")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="compile the decode step (auto: on CUDA only)")
    p.add_argument("--mode", default="auto", help="torch.compile mode (auto: reduce-overhead on CUDA) | none")
    p.add_argument("--lower", default="all", help="IR ops to map to llmaccel:: custom ops: all | none | op,op")
    p.add_argument("--linear", default="auto", choices=["auto", "mm", "rows", "gemv"],
                   help="decode linears: mm (cuBLAS), rows (Inductor GEMV) or gemv (fused Triton GEMV); "
                        "auto: gemv at batch 1 on CUDA")
    p.add_argument("--attn", default="auto", choices=["auto", "sdpa", "grouped", "fused", "rows"],
                   help="decode attention over the static cache (auto: fused on CUDA, rows on the CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--speculative", default=None, metavar="DRAFT",
                   help="also run greedy speculative decoding (batch 1): ngram | self:N (first N layers); "
                        "several, comma-separated, are each compared with the same plain decode")
    p.add_argument("--spec-k", type=int, default=4, help="tokens the draft proposes per round")
    p.add_argument("--prompt", default=None, help="prompt text instead of --prompt-len random tokens")
    p.add_argument("--tune", action="store_true", help="Inductor coordinate-descent tuning (slower compile)")
    p.add_argument("--no-bw", action="store_true", help="skip measuring the copy bandwidth")
    p.add_argument("--no-profile", action="store_true", help="skip the per-step kernel profile (CUDA)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(fn=cmd_bench)


def main(argv=None) -> int:
    """Run `bench` alone (python -m llmaccel.bench ...), with llmc's error handling."""
    import sys

    from llmaccel import cli

    args = list(sys.argv[1:] if argv is None else argv)
    return cli.main(args if args[:1] == ["bench"] else ["bench", *args])
