"""llama.cpp as a peer of `llmc bench` on the CPU (`--peer llama.cpp[:TYPE]`): the same prompt
token ids and output length through llama-cpp-python on a GGUF of the same model, in the same
process right after LLM, with the same thread count; its figures measured as LLM's are (output
tokens over the whole generate, prefill included, after one warm-up run).

The built-in model's file is a Q4_1 GGUF (its head Q8_0); another type (Q8_0, F16, ...) is made
from it once with llama.cpp's own quantizer and kept in the cache folder. llama-cpp-python builds
llama.cpp from source on install (about 6 minutes on 2 cores): `pip install 'llmaccel[llamacpp]'`.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from llmaccel.errors import LlmaccelError, require_extra

# llama.cpp's ftype numbers (llama.h: enum llama_ftype) of the types a peer file may be made in
FTYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q6_K": 18}


def parse_peer(spec: str | None) -> tuple[str, str | None] | None:
    """'llama.cpp' | 'llama.cpp:TYPE' | 'llama.cpp:/path/file.gguf' -> ('llama.cpp', TYPE or path)."""
    if spec is None:
        return None
    name, _, arg = spec.partition(":")
    if name != "llama.cpp":
        raise LlmaccelError(f"--peer: unknown peer {name!r} (llama.cpp, llama.cpp:TYPE or llama.cpp:FILE.gguf)")
    if arg and not arg.endswith(".gguf") and arg not in FTYPES:
        raise LlmaccelError(f"--peer llama.cpp:{arg}: a GGUF file or one of {', '.join(FTYPES)}")
    return name, arg or None


def peer_gguf(src: str, arg: str | None) -> Path:
    """The GGUF the peer runs: a file given, or the built-in model's file in the type asked for."""
    if arg and arg.endswith(".gguf"):
        if not Path(arg).is_file():
            raise LlmaccelError(f"--peer llama.cpp:{arg}: no such file")
        return Path(arg)
    from llmaccel.compiler.sources import BUILTIN, builtin_gguf, cache_dir
    if src not in BUILTIN:
        raise LlmaccelError(f"--peer llama.cpp needs a GGUF of {src}: pass llama.cpp:FILE.gguf")
    base = builtin_gguf(src)
    if arg in (None, "Q4_1"):
        return base
    cache = cache_dir() / "peers"
    out = cache / f"{base.stem}.{arg}.gguf"
    if not out.is_file():
        llama_cpp = require_extra("llama_cpp", "llamacpp", "--peer llama.cpp")
        cache.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = FTYPES[arg], True, torch.get_num_threads()
        tmp = out.with_suffix(".part")
        if llama_cpp.llama_model_quantize(str(base).encode(), str(tmp).encode(), params) != 0:
            raise LlmaccelError(f"llama.cpp could not write {arg} from {base}")
        tmp.rename(out)
    return out


def run_llama_cpp(path: Path, prompts: list[list[int]], gen_len: int, warmup: int = 1) -> dict:
    """One request at a time (llama-cpp-python decodes one sequence): tok/s over every output
    token of the requests, time to the first token of the first."""
    llama_cpp = require_extra("llama_cpp", "llamacpp", "--peer llama.cpp")
    threads = torch.get_num_threads()
    n_ctx = max(len(p) for p in prompts) + gen_len + 8
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          n_batch=min(512, n_ctx), verbose=False)
    vocab = llm.n_vocab()
    prompts = [[t % vocab for t in p] for p in prompts]

    def once() -> tuple[float, float]:
        t0, ttft = time.perf_counter(), None
        for p in prompts:
            llm.reset()  # else generate() reuses the cached prefix of the run before: no prefill
            for n, _ in enumerate(llm.generate(p, temp=0.0, top_k=1, reset=True), 1):
                ttft = ttft or time.perf_counter() - t0
                if n == gen_len:
                    break
        return time.perf_counter() - t0, ttft
    for _ in range(warmup):
        once()
    total, ttft = once()
    return {"peer": "llama.cpp", "gguf": str(path), "llama_cpp_python": llama_cpp.__version__,
            "threads": threads, "decode_tok_s": len(prompts) * gen_len / total, "ttft_s": ttft}
