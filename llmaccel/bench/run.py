"""Measure `LLM`, the path users run, the way the peers in ../shared/bench measure theirs.

`batch` requests are added at once (a static batch through the continuous-batching engine).
decode_tok_s: batch * gen output tokens over the whole generate call (prefill included: its
token is the first output), after warm-up runs, so the figure compares with the peers' directly.
decode_step_tok_s: batch / time per decode step, the decode phase alone (at long prompts the
prefill dominates the whole generate; a KV-cache format changes only the decode phase).
The roofline divides the bytes a decode step must read (every weight once, except an untied
embedding table of which a step reads a few rows, plus the KV cache at the mean context length)
by the device-to-device copy bandwidth measured in the run.
"""
from __future__ import annotations

import dataclasses
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

from llmaccel import ops
from llmaccel.ir import attention_layers, get_attr
from llmaccel.errors import LlmaccelError

PROMPT_SETS = ("random", "grounded", "open")  # --prompts; the last two: eval/prompts.py


def weight_bytes_per_step(gm: torch.fx.GraphModule) -> int:
    """Bytes of every tensor the graph reads in full at each step (embedding-only tables excluded)."""
    seen, total = set(), 0
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        if n.users and all(u.op == "call_function" and u.target is ops.embedding and u.args[1] is n
                           for u in n.users):
            continue
        t = get_attr(gm, n.target)
        key = (t.data_ptr(), t.numel()) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def kv_bytes_per_step(gm: torch.fx.GraphModule, batch: int, context: float, elem_size: int) -> float:
    """Cache bytes a decode step reads: K and V of every token in the model's dtype, or in a
    KIVI layer codes, scales and mins (its full-precision recent tokens counted as quantized)."""
    from llmaccel.compiler.executor import kv_quant_specs
    from llmaccel.ops.kvquant import bytes_per_token

    specs = kv_quant_specs(gm)
    return sum(batch * context * (bytes_per_token(specs[i], kv, hd, scale_bytes=elem_size) if i in specs
                                  else 2 * kv * hd * elem_size)
               for i, (kv, hd) in attention_layers(gm).items())


def cuda_time_us(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median microseconds per call of `fn` on the current CUDA device (events, after warm-up)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written per second); None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    bw = 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return bw


def profile_decode(llm, ids, params, steps: int = 16) -> dict:
    """Kernels per decode sub-step and their GPU time, from the profiler over one generate of
    `steps` tokens per request (CUDA graph replays included; the prefill's kernels counted in,
    a small share at these lengths). GPU time per step against the wall time per step says how
    much is launch gaps and host work."""
    from torch.profiler import ProfilerActivity, profile

    short = [dataclasses.replace(p, max_tokens=steps) for p in params]
    llm.generate(ids, short)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(ids, short)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f"{d}/trace.json")
        with open(f"{d}/trace.json") as f:
            trace = json.load(f)
    acts = [(e["name"], float(e["ts"]), float(e.get("dur", 0))) for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return {**kernel_table(prof, steps), **decode_timeline(acts, steps - 1)}


def decode_timeline(acts: list[tuple[str, float, float]], steps: int, top: int = 5) -> dict:
    """Where a decode step's wall time goes on the GPU, from its activities (name, start us,
    duration us): the decode phase runs from the end of the last prefill kernel (the whole
    span without one) to the end of the last activity; busy is the union of the activities'
    intervals there (kernels launched early by PDL overlap the one before), idle the rest: time
    the GPU waited for the host. The largest idle spans are summed by the pair of activities
    around them."""
    if not acts or steps < 1:
        return {}
    acts = sorted(acts, key=lambda a: a[1])
    pre = [a[1] + a[2] for a in acts if "prefill" in a[0]]
    t0 = max(pre) if pre else acts[0][1]
    end = max(a[1] + a[2] for a in acts)
    busy, cur_end, prev, gaps = 0.0, t0, "prefill" if pre else None, {}
    for name, ts, dur in acts:
        e = ts + dur
        if e <= t0:
            continue
        s = max(ts, t0)
        if s > cur_end:
            g = gaps.setdefault((prev, name), [0, 0.0])
            g[0] += 1
            g[1] += s - cur_end
        if e > cur_end:
            busy += e - max(s, cur_end)
            cur_end, prev = e, name
    wall = end - t0
    worst = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]
    return {"decode_wall_ms_per_step": wall / 1e3 / steps, "decode_busy_ms_per_step": busy / 1e3 / steps,
            "decode_idle_ms_per_step": (wall - busy) / 1e3 / steps,
            "decode_idle_gaps": [{"after": (a or "-")[:60], "before": b[:60], "count": n,
                                  "us_per_step": round(us / steps, 2)} for (a, b), (n, us) in worst]}


def kernel_table(prof, steps: int) -> dict:
    """Kernels per step, GPU ms per step and every kernel's share, from a finished profiler run
    over `steps` steps."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0)
        if e.count and t and getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU:
            rows.append((e.key, e.count / steps, t / 1e3 / steps))
    rows.sort(key=lambda r: -r[2])
    return {"kernels_per_step": sum(r[1] for r in rows),
            "gpu_ms_per_step": sum(r[2] for r in rows),
            "top_kernels": [{"name": n[:80], "per_step": c, "ms": round(ms, 4)} for n, c, ms in rows[:10]],
            "kernels": [{"name": n[:160], "per_step": c, "ms": round(ms, 5)} for n, c, ms in rows]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device) -> tuple[float, object]:
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def passes_to_run(src: str, passes, options: dict | None = None) -> list[str]:
    """The passes the bench runs on `src`: those asked for, less any that an artifact has run
    already (its recipe), so that an artifact is measured as it was compiled."""
    from llmaccel.compiler.artifact import is_artifact, read_manifest
    from llmaccel.compiler.pipeline import parse_pass_list

    names = parse_pass_list(passes)
    if not is_artifact(src):
        return names
    recipe = read_manifest(Path(src)).get("recipe")
    done = {p.get("name") for p in recipe if isinstance(p, dict)} if isinstance(recipe, list) else set()
    for name in options or {}:
        if name in done:
            raise LlmaccelError(f"{src} has run {name} already and the bench does not run it "
                                f"again; drop --set {name}.*")
    return [n for n in names if n not in done]


def bench(src: str, *, batch: int = 1, prompt_len: int = 128, gen_len: int = 256, dtype="auto",
          device="auto", passes="fuse", options: dict | None = None, temperature: float = 0.0,
          top_p: float = 1.0, top_k: int = 0, warmup: int = 2, measure_bw: bool = True,
          seed: int = 0, speculative: str | None = None, spec_k: int = 4, prompt: str | None = None,
          cuda_graphs: bool = True, compile: bool | None = None, profile: bool = True,
          prefix_caching: bool = False, tp: int = 1, peer: tuple[str, str | None] | None = None,
          prompts: str = "random", kv_cache_gib: float | None = None) -> dict:
    """`batch` requests of prompt_len tokens, all added at once to `LLM`, each generating
    exactly gen_len tokens (ignore_eos); the figures of the last of warmup + 1 runs. Prefix
    caching is off unless asked for: every run repeats the same prompts, which it would
    otherwise find cached, and the peers compute their whole prefill. prompts: "random"
    (prompt_len random tokens, or `prompt`), or a set of eval/prompts.py ("grounded", "open"):
    request i takes the set's prompt i mod its size, at that prompt's own length. kv_cache_gib:
    a fixed KV-cache budget (LLM's kv_cache_bytes), where a cache of fewer bytes per token
    runs more requests at once (running_peak)."""
    from llmaccel.compiler.model import resolve_device
    from llmaccel.compiler.pipeline import compile as compile_model
    from llmaccel.runtime.engine import LLM
    from llmaccel.sampling import SamplingParams

    _check_counts(batch=batch, prompt_len=prompt_len, gen_len=gen_len, warmup=warmup, spec_k=spec_k)
    device = resolve_device(device)
    dev = torch.device(device)
    peer_file = _peer_file(src, peer)  # before minutes of compiling: a missing extra fails now
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    sp = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=gen_len,
                         ignore_eos=True, seed=seed + i) for i in range(batch)]
    t0 = time.perf_counter()
    model = compile_model(src, passes_to_run(src, passes, options), options or {}, dtype=dtype,
                          device=device, eval_tokens=0, progress=False)
    load_s = time.perf_counter() - t0
    ids = _prompts(model, prompt, prompts, batch, prompt_len, gen_len, seed)
    prompt_len = sum(map(len, ids)) / batch  # the mean where a set's prompts differ in length
    llm = LLM(model, max_num_seqs=batch, speculative=speculative, num_speculative_tokens=spec_k,
              max_num_batched_tokens=max(2048, min(sum(map(len, ids)), 16384)),
              cuda_graphs=cuda_graphs, compile=compile, enable_prefix_caching=prefix_caching,
              tensor_parallel_size=tp, kv_cache_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30))
    warm_s, prefill_s, gen_s, peak, m0, m1 = _measure(llm, ids, sp, dev, warmup)
    res = _figures(src, model, dev, batch, prompt_len, gen_len, (temperature, top_p, top_k), speculative,
                   prefix_caching, (load_s, warm_s, prefill_s, gen_s), peak, _engine_counts(m0, m1, speculative))
    step_s, step_bytes = res["step_ms"] and res["step_ms"] / 1e3, res["bytes_per_step"]
    if dev.type == "cuda" and profile and gen_len > 16:
        try:
            res.update(profile_decode(llm, ids, sp))
        except Exception as e:  # the profile is extra information; the figures above stand
            res["profile_error"] = f"{type(e).__name__}: {e}"[:200]
    llm.close()
    res.update(tensor_parallel_size=tp, prompt_set="text" if prompt is not None else prompts)
    _run_peer(res, peer_file, ids, gen_len)
    measured_bw = copy_bandwidth(dev) if measure_bw else None
    if measured_bw and step_s and tp == 1:  # a rank's bytes are not the whole model's
        res.update(copy_bw_measured=measured_bw, roofline_tok_s=batch * measured_bw / step_bytes,
                   roofline_frac=(step_bytes / measured_bw) / step_s)
    return res


def _figures(src, model, dev, batch, prompt_len, gen_len, sampling, speculative, prefix_caching,
             times, peak, counts) -> dict:
    """The result of a measured run: times = (load, warm-up, prefill, generate) seconds."""
    load_s, warm_s, prefill_s, gen_s = times
    temperature, top_p, top_k = sampling
    elem = torch.empty((), dtype=model.dtype).element_size()
    w_bytes = weight_bytes_per_step(model.gm)
    kv_bytes = kv_bytes_per_step(model.gm, batch, prompt_len + gen_len / 2, elem)
    step_s = (gen_s - prefill_s) / (gen_len - 1) if gen_len > 1 else None
    return {
        "tool": "llmc", "engine": "LLM", "src": src, "batch": batch, "prompt": round(prompt_len),
        "prompt_tokens_mean": prompt_len, "gen": gen_len,
        "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "dtype": str(model.dtype).removeprefix("torch."), "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "passes": [p["name"] for p in model.recipe], "speculative": speculative,
        "pass_options": {p["name"]: p.get("options", {}) for p in model.recipe},
        "prefix_caching": prefix_caching,
        "decode_tok_s": batch * gen_len / gen_s,
        # the decode phase alone (what a KV-cache format changes at long prompts)
        "decode_step_tok_s": batch / step_s if step_s and step_s > 0 else None,
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "ttft_s": prefill_s, "tpot_ms": 1e3 * gen_s / gen_len, "step_ms": step_s and 1e3 * step_s,
        "generate_s": gen_s, "peak_mem_bytes": int(peak), "weight_bytes": w_bytes,
        "kv_bytes_per_step": int(kv_bytes), "bytes_per_step": int(w_bytes + kv_bytes), "load_s": load_s,
        "warmup_s": warm_s, "torch": torch.__version__, **counts,
    }


def _check_counts(**counts) -> None:
    least = {"warmup": 0}
    for name, value in counts.items():
        if value < least.get(name, 1):
            raise LlmaccelError(f"--{name.replace('_', '-')} must be >= {least.get(name, 1)}, got {value}")


def _run_peer(res: dict, peer_file: Path | None, ids, gen_len: int) -> None:
    """The llama.cpp peer's figures on the same prompts, after LLM has closed, and LLM's ratio."""
    if peer_file is not None:
        from llmaccel.bench.llama_cpp_peer import run_llama_cpp
        res["peer"] = run_llama_cpp(peer_file, ids, gen_len)
        res["x_peer"] = res["decode_tok_s"] / res["peer"]["decode_tok_s"]


def _peer_file(src: str, peer) -> Path | None:
    """The GGUF the llama.cpp peer runs (made now if a type is asked for), its package checked."""
    if peer is None:
        return None
    from llmaccel.bench.llama_cpp_peer import peer_gguf
    from llmaccel.errors import require_extra
    require_extra("llama_cpp", "llamacpp", "--peer llama.cpp")
    return peer_gguf(src, peer[1])


def _measure(llm, ids, sp, dev, warmup: int) -> tuple:
    """(warm-up s, prefill s (best of 2), generate s, peak memory, metrics before and after the
    measured run) of `warmup` + 1 runs of the same requests."""
    warm_s, _ = _timed(lambda: [llm.generate(ids, sp) for _ in range(warmup)], dev)
    first = [dataclasses.replace(p, max_tokens=1) for p in sp]
    prefill_s = min(_timed(lambda: llm.generate(ids, first), dev)[0] for _ in range(2))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    m0 = llm.metrics()
    gen_s, outs = _timed(lambda: llm.generate(ids, sp), dev)
    m1 = llm.metrics()
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gen_len = sp[0].max_tokens
    bad = [o for o in outs if len(o.token_ids) != gen_len]
    if bad:
        raise LlmaccelError(f"request {bad[0].request_id} ended after {len(bad[0].token_ids)} tokens "
                            f"({bad[0].finish_reason}: {bad[0].error}); the bench needs {gen_len}")
    return warm_s, prefill_s, gen_s, peak, m0, m1


def _prompts(model, prompt: str | None, prompt_set: str, batch: int, prompt_len: int, gen_len: int,
             seed: int) -> list[list[int]]:
    """The batch's prompt ids: `prompt` encoded, a set's prompts in turn, or seeded random tokens."""
    if prompt_set not in PROMPT_SETS:
        raise LlmaccelError(f"--prompts must be one of {', '.join(PROMPT_SETS)}, got {prompt_set!r}")
    if prompt is not None and prompt_set != "random":
        raise LlmaccelError(f"--prompt and --prompts {prompt_set} both give the prompts; use one")
    if prompt is not None:
        ids = [model.encode(prompt)] * batch
        if not ids[0]:
            raise LlmaccelError("--prompt encodes to no tokens")
    elif prompt_set != "random":
        from llmaccel.eval import prompts as sets
        from llmaccel.eval.text import text_encoder

        # a preset has no tokenizer: it reads the text as bytes, which keeps the repeats a draft
        # that copies from the prompt can find
        texts, enc = getattr(sets, prompt_set.upper()), text_encoder(model)
        ids = [enc(texts[i % len(texts)]) for i in range(batch)]
    else:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).tolist()
    need = max(map(len, ids)) + gen_len
    if need > model.config.max_position:
        raise LlmaccelError(f"prompt + gen = {need} exceeds the model's {model.config.max_position} positions")
    return ids


def _engine_counts(m0: dict, m1: dict, speculative) -> dict:
    """The engine's counters over the measured run (metrics before and after)."""
    return {"engine_steps": m1["steps"] - m0["steps"], "decode_substeps": m1["decode_steps"] - m0["decode_steps"],
            "graphs_captured": m1["graphs_captured"],
            "graph_failures": {str(k): v for k, v in m1["graph_failures"].items()},
            "spec_accept_rate": m1["spec_accept_rate"] if speculative else None,
            "decode_compiled": m1["decode_compiled"], "threads": m1["threads"],
            "cpu_bf16_linears": m1["cpu_bf16_linears"], "running_peak": m1["running_peak"],
            **{k: m1.get(k) for k in ("kv_dtype", "kv_bytes_per_token", "kv_cache_tokens")}}


def render(res: dict) -> str:
    sampling = "greedy" if not res["temperature"] else (
        f"temperature {res['temperature']}, top_p {res['top_p']}, top_k {res['top_k']}")
    prompt = (f"prompts {res['prompt_set']} (mean {res['prompt_tokens_mean']:.1f} tokens)"
              if res.get("prompt_set") in PROMPT_SETS[1:] else f"prompt {res['prompt']}")
    lines = [f"{res['src']} {res['dtype']} on {res['device_name']}: {res['batch']} request(s), "
             f"{prompt}, gen {res['gen']}, {sampling} (passes: {','.join(res['passes']) or '-'}"
             f"{', speculative ' + res['speculative'] if res['speculative'] else ''}; LLM)",
             f"  decode   {res['decode_tok_s']:10.1f} tok/s  (output tokens over the whole generate)",
             f"  prefill  {res['prefill_tok_s']:10.1f} tok/s  (time to first token {1e3 * res['ttft_s']:.1f} ms)",
             f"  per step {res['step_ms'] or 0:10.3f} ms     (time per output token {res['tpot_ms']:.3f} ms; "
             f"decode phase {res['decode_step_tok_s'] or 0:.1f} tok/s; {res['engine_steps']} engine steps, "
             f"{res['decode_substeps']} decode sub-steps)",
             f"  peak mem {res['peak_mem_bytes'] / 2**30:10.2f} GiB",
             f"  bytes/step {res['bytes_per_step'] / 1e9:8.3f} GB  (weights {res['weight_bytes'] / 1e9:.3f}, "
             f"KV {res['kv_bytes_per_step'] / 1e9:.3f})"]
    if "roofline_tok_s" in res:
        lines.append(f"  roofline {res['roofline_tok_s']:10.1f} tok/s at {res['copy_bw_measured'] / 1e12:.2f} TB/s "
                     f"(measured copy); decode phase at {100 * res['roofline_frac']:.1f}% of it")
    if res.get("threads"):
        lines.append(f"  cpu      {res['threads']:10d} threads, decode step {res['decode_compiled']}, "
                     f"{res['cpu_bf16_linears']} linears in bf16")
    if "peer" in res:
        p = res["peer"]
        lines.append(f"  peer     {p['decode_tok_s']:10.1f} tok/s  llama.cpp on {Path(p['gguf']).name} "
                     f"(time to first token {1e3 * p['ttft_s']:.1f} ms): LLM at {res['x_peer']:.2f}x")
    if res["speculative"]:
        lines.append(f"  speculative acceptance {100 * (res['spec_accept_rate'] or 0):.1f}%")
    if "kernels_per_step" in res:
        lines.append(f"  profile  {res['kernels_per_step']:10.1f} kernels/step, GPU busy "
                     f"{res['gpu_ms_per_step']:.3f} ms/step")
    if "decode_wall_ms_per_step" in res:
        lines.append(f"  timeline {res['decode_wall_ms_per_step']:10.3f} ms/decode step profiled: GPU busy "
                     f"{res['decode_busy_ms_per_step']:.3f}, idle {res['decode_idle_ms_per_step']:.3f}")
    return "\n".join(lines)
