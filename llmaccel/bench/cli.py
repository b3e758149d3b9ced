"""Argparse wiring of `llmc bench` (llmaccel/cli.py calls add_parser)."""
from __future__ import annotations

import json

from llmaccel.errors import LlmaccelError


def _bool_or_auto(v: str) -> bool | None:
    return {"auto": None, "on": True, "off": False}[v]


def cmd_bench(a) -> None:
    from llmaccel.bench.run import bench, render
    from llmaccel.compiler.sources import check_draft
    from llmaccel.bench.llama_cpp_peer import parse_peer
    from llmaccel.passes.base import parse_sets

    check_draft(a.speculative)
    peer = parse_peer(a.peer)
    if a.tp < 1:
        raise LlmaccelError(f"--tp must be >= 1, got {a.tp}")
    if a.kv_cache_gib is not None and not a.kv_cache_gib > 0:
        raise LlmaccelError(f"--kv-cache-gib must be positive, got {a.kv_cache_gib}")
    res = bench(a.src, batch=a.batch, prompt_len=a.prompt_len, gen_len=a.gen_len, dtype=a.dtype,
                device=a.device, passes=a.passes, options=parse_sets(a.set), temperature=a.temperature,
                top_p=a.top_p, top_k=a.top_k, warmup=a.warmup, measure_bw=not a.no_bw,
                profile=not a.no_profile, speculative=a.speculative, spec_k=a.spec_k, prompt=a.prompt,
                cuda_graphs=a.cuda_graphs == "on", compile=_bool_or_auto(a.compile),
                prefix_caching=a.prefix_caching, tp=a.tp, peer=peer, prompts=a.prompts,
                kv_cache_gib=a.kv_cache_gib)
    print(render(res))
    if a.json:
        print(json.dumps(res))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="speed of LLM (the engine users run): tok/s, time per token, "
                                            "memory, roofline")
    p.add_argument("src", help="preset:NAME | smollm2-135m | HF dir | .gguf | artifact dir")
    p.add_argument("--batch", type=int, default=1, help="requests added at once")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float32 | float16")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--passes", default="fuse", help="passes run first (default: fuse); on an "
                                                    "artifact, those it has not run already")
    p.add_argument("--set", action="append", default=[], metavar="PASS.KEY=VALUE")
    p.add_argument("--cuda-graphs", default="on", choices=["on", "off"], help="decode steps as CUDA graphs")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="Inductor on the decode step (auto: on CUDA, and on a CPU where Inductor "
                        "finds a C++ compiler)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefix-caching", action="store_true",
                   help="keep prefix caching on: the measured run then finds its prompts (those "
                        "of the warm-up runs) cached and prefills only their last block")
    p.add_argument("--kv-cache-gib", type=float, default=None, metavar="GIB",
                   help="a fixed KV-cache budget (default: a fraction of the GPU's memory); the JSON's "
                        "running_peak says how many requests ran at once in it")
    p.add_argument("--speculative", default=None, metavar="DRAFT", help="ngram | self | self:int4 | SRC")
    p.add_argument("--spec-k", type=int, default=4, help="tokens the draft proposes per round")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel ranks (LLM(tensor_parallel_size=N))")
    p.add_argument("--prompt", default=None, help="prompt text instead of --prompt-len random tokens")
    p.add_argument("--prompts", default="random", choices=["random", "grounded", "open"],
                   help="random: --prompt-len random tokens (or --prompt). grounded: prompts whose "
                        "answer repeats a passage they carry (what ngram can copy); open: stories, "
                        "explanations, advice. With a set (llmaccel/eval/prompts.py), request i takes "
                        "its prompt i mod the set's size, and a prompt's length is its own token count "
                        "(its UTF-8 bytes on a model without a tokenizer), not --prompt-len; the JSON "
                        "gives prompt_set and prompt_tokens_mean")
    p.add_argument("--peer", default=None, metavar="llama.cpp[:TYPE|:FILE.gguf]",
                   help="run llama.cpp (llama-cpp-python) on a GGUF of the model after LLM, same "
                        "prompts and threads: the built-in model's Q4_1 file, that file made into "
                        "TYPE (Q8_0, F16, ...) once, or a file")
    p.add_argument("--no-bw", action="store_true", help="skip measuring the copy bandwidth")
    p.add_argument("--no-profile", action="store_true", help="skip the per-step kernel profile (CUDA)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(fn=cmd_bench, flags={"temperature": "--temperature", "top_k": "--top-k",
                                        "top_p": "--top-p"})
