"""Measure the static-batch decode path the way the peers in ../shared/bench measure theirs.

decode_tok_s: batch * gen output tokens over the whole generate call (prefill included: its
token is the first output), after warm-up runs, so the figure compares with the peers' directly.
decode_step_tok_s: batch / time per decode step, the decode phase alone (at long prompts the
prefill dominates the whole generate; a KV-cache format changes only the decode phase).
The roofline divides the bytes a decode step must read (every weight once, except an untied
embedding table of which a step reads a few rows, plus the KV cache at the mean context length)
by a copy bandwidth: 4.27e12 B/s measured on the H200, or the one measured in the run.
"""
from __future__ import annotations

import dataclasses
import math
import resource
import time

import torch

from llmaccel import ops
from llmaccel.codegen.engine import DecodeEngine
from llmaccel.codegen.lower import attention_layers
from llmaccel.compiler.model import get_attr
from llmaccel.errors import LlmaccelError

H200_COPY_BW = 4.27e12  # B/s, measured device-to-device copy (read + write) on one H200


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


def profile_decode(eng: DecodeEngine, ids: torch.Tensor, steps: int = 8) -> dict:
    """Kernels per decode step and their GPU time, from the profiler (CUDA graph replays included).

    GPU time per step against the wall time per step says how much is launch gaps and host work.
    """
    from torch.profiler import ProfilerActivity, profile

    eng.start(ids)
    for _ in range(2):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    return kernel_table(prof, steps)


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


def bench(src: str, *, batch: int = 1, prompt_len: int = 128, gen_len: int = 256, dtype="auto",
          device="auto", passes="fuse", options: dict | None = None, compile: bool | None = None,
          mode: str | None = "auto", lower_ops="all", linear: str = "auto", attn: str = "auto",
          warmup: int = 2, measure_bw: bool = True, tune: bool = False, profile: bool = True,
          seed: int = 0, speculative: str | None = None, spec_k: int = 4,
          prompt: str | None = None) -> dict:
    from llmaccel.compiler.pipeline import compile as compile_model

    if min(batch, prompt_len, gen_len) < 1:
        raise LlmaccelError(f"--batch, --prompt-len and --gen-len must be positive "
                            f"(got {batch}, {prompt_len}, {gen_len})")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LlmaccelError("--device cuda given but no CUDA device is available")
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    t0 = time.perf_counter()
    model = compile_model(src, passes, options or {}, dtype=dtype, device=device, eval_tokens=0,
                          progress=False)
    load_s = time.perf_counter() - t0
    if prompt is not None:
        prompt_ids = model.encode(prompt)
        if not prompt_ids:
            raise LlmaccelError("--prompt encodes to no tokens")
        prompt_len = len(prompt_ids)
    if speculative is not None and batch != 1:
        raise LlmaccelError("--speculative runs at --batch 1")
    need = prompt_len + gen_len + (spec_k + 1 if speculative else 0)
    max_len = min(64 * math.ceil(need / 64), model.config.max_position)
    if need > max_len:
        raise LlmaccelError(f"prompt + gen = {need} exceeds the model's {model.config.max_position} positions")
    eng = DecodeEngine(model, batch, max_len, compile=compile, mode=mode, lower_ops=lower_ops,
                       linear=linear, attn=attn, tune=tune)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).to(dev)
    if prompt is not None:
        ids = torch.tensor([prompt_ids], device=dev)

    from torch._dynamo.utils import counters

    skips0 = counters["inductor"]["cudagraph_skips"]
    warm_s, _ = _timed(lambda: [eng.generate(ids, gen_len) for _ in range(warmup)], dev)
    prefill_s = min(_timed(lambda: eng.prefill(ids), dev)[0] for _ in range(3))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    gen_s, out = _timed(lambda: eng.generate(ids, gen_len), dev)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert out.shape == (batch, gen_len)

    elem = torch.empty((), dtype=model.dtype).element_size()
    w_bytes = weight_bytes_per_step(model.gm)
    kv_bytes = kv_bytes_per_step(model.gm, batch, prompt_len + gen_len / 2, elem)
    step_bytes = w_bytes + kv_bytes
    step_s = (gen_s - prefill_s) / (gen_len - 1) if gen_len > 1 else None
    measured_bw = copy_bandwidth(dev) if measure_bw else None
    res = {
        "tool": "llmc", "src": src, "batch": batch, "prompt": prompt_len, "gen": gen_len,
        "dtype": str(model.dtype).removeprefix("torch."), "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "passes": [p["name"] for p in model.recipe], "compiled": eng.compiled,
        "linear": eng.linear, "gemv_fusions": eng.decode_report.gemv, "attn": eng.attn, "tune": tune, "max_len": max_len,
        "custom_ops": eng.report.custom, "custom_ops_rejected": sorted(eng.report.rejected),
        "cpu_traced_ops": eng.report.cpu_traced,
        "decode_tok_s": batch * gen_len / gen_s,
        # the decode phase alone (what a KV-cache format changes at long prompts)
        "decode_step_tok_s": batch / step_s if step_s else None,
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "tpot_ms": 1e3 * gen_s / gen_len, "step_ms": step_s and 1e3 * step_s, "generate_s": gen_s,
        "peak_mem_bytes": int(peak), "weight_bytes": w_bytes, "kv_bytes_per_step": int(kv_bytes),
        "bytes_per_step": int(step_bytes), "load_s": load_s, "warmup_s": warm_s,
        "torch": torch.__version__,
    }
    if dev.type == "cuda" and eng.compiled:
        # each skip means a step runs kernel by kernel; TORCH_LOGS=cudagraphs says why
        res["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips0
    if speculative is not None:
        # several drafts (comma-separated) are measured against the same plain decode
        res["speculative"] = [_bench_speculative(src, model, eng, ids, gen_len, out, spec.strip(), spec_k,
                                                 passes, dtype, device, warmup, dev, profile)
                              for spec in speculative.split(",") if spec.strip()]
    if dev.type == "cuda" and profile and gen_len > 12:
        try:
            res.update(profile_decode(eng, ids))
        except Exception as e:  # the profile is extra information; the figures above stand
            res["profile_error"] = f"{type(e).__name__}: {e}"[:200]
    if dev.type == "cuda":
        bw = H200_COPY_BW
        res.update(copy_bw_measured=measured_bw, roofline_bw=bw,
                   roofline_tok_s=batch * bw / step_bytes,
                   roofline_frac=(step_bytes / bw) / step_s if gen_len > 1 else None)
        if measured_bw:
            res["roofline_frac_measured_bw"] = (step_bytes / measured_bw) / step_s if gen_len > 1 else None
    return res


def _bench_speculative(src, model, eng, ids, gen_len, plain_out, spec, k, passes, dtype, device,
                       warmup, dev, profile: bool = True) -> dict:
    """Greedy speculative decode against the plain decode just measured: speed-up and equality."""
    from llmaccel.codegen.speculative import SpeculativeDecoder, parse_draft
    from llmaccel.compiler.model import Model, load
    from llmaccel.compiler.pipeline import parse_pass_list
    from llmaccel.passes import get_pass
    from llmaccel.passes.base import PassContext
    from llmaccel.runtime.graph import layerskip_draft

    kind = parse_draft(spec, model.config.n_layers)
    draft = "ngram"
    if kind != "ngram":
        raw = load(src, dtype=dtype, device=device)
        dgm = layerskip_draft(raw.gm, raw.config, kind)
        dcfg = dataclasses.replace(raw.config, n_layers=kind)
        if "fuse" in parse_pass_list(passes):
            dgm = get_pass("fuse")().run(dgm, PassContext(dcfg, device)).gm
            dgm.recompile()
        dmodel = Model(dgm, dcfg, source=f"{src} (first {kind} layers)", dtype=raw.dtype, device=device)
        draft = DecodeEngine(dmodel, 1, eng.max_len, compile=eng.compiled or None,
                             linear=eng.linear, attn=eng.attn, cache=eng.cache)
    dec = SpeculativeDecoder(eng, draft, k)
    _timed(lambda: [dec.generate(ids, gen_len) for _ in range(warmup)], dev)
    spec_s, out = _timed(lambda: dec.generate(ids, gen_len), dev)
    same = (out == plain_out).all(-1)
    first_diff = None if bool(same.all()) else int((out != plain_out).long().argmax(-1)[0])
    stats = dec.stats()
    res = {"speculative": spec, "spec_decode_tok_s": gen_len / spec_s, "spec_generate_s": spec_s,
           "spec_identical_to_plain": bool(same.all()), "spec_first_difference": first_diff, **stats}
    if dev.type == "cuda" and profile and stats["spec_rounds"]:
        # where a round's time goes: its kernels (k draft steps + one verify) against its wall
        # time; the prefill's kernels are spread over the rounds (a few percent of them)
        from torch.profiler import ProfilerActivity, profile as profiler

        try:
            with profiler(activities=[ProfilerActivity.CUDA]) as prof:
                dec.generate(ids, gen_len)
                torch.cuda.synchronize()
            table = kernel_table(prof, dec.stats()["spec_rounds"])
            res.update(spec_round_ms=spec_s / stats["spec_rounds"] * 1e3,
                       spec_round_gpu_ms=table["gpu_ms_per_step"], spec_round_kernels=table["kernels_per_step"],
                       spec_round_top_kernels=table["top_kernels"])
        except Exception as e:  # the profile is extra information; the figures above stand
            res["spec_profile_error"] = f"{type(e).__name__}: {e}"[:200]
    return res


def render(res: dict) -> str:
    lines = [f"{res['src']} {res['dtype']} on {res['device_name']}: batch {res['batch']}, "
             f"prompt {res['prompt']}, gen {res['gen']} (passes: {','.join(res['passes']) or '-'}, "
             f"compiled: {res['compiled']}, linear {res['linear']}, attn {res['attn']})",
             f"  decode   {res['decode_tok_s']:10.1f} tok/s  (output tokens over the whole generate)",
             f"  prefill  {res['prefill_tok_s']:10.1f} tok/s",
             f"  per step {res['step_ms'] or 0:10.3f} ms     (time per output token {res['tpot_ms']:.3f} ms; "
             f"decode phase {res['decode_step_tok_s'] or 0:.1f} tok/s)",
             f"  peak mem {res['peak_mem_bytes'] / 2**30:10.2f} GiB",
             f"  bytes/step {res['bytes_per_step'] / 1e9:8.3f} GB  (weights {res['weight_bytes'] / 1e9:.3f}, "
             f"KV {res['kv_bytes_per_step'] / 1e9:.3f})"]
    if "roofline_tok_s" in res:
        lines.append(f"  roofline {res['roofline_tok_s']:10.1f} tok/s at {res['roofline_bw'] / 1e12:.2f} TB/s; "
                     f"decode step at {100 * (res['roofline_frac'] or 0):.1f}% of it")
    for sp in res.get("speculative", []):
        lines.append(f"  speculative {sp['speculative']} (k={sp['spec_k']}): {sp['spec_decode_tok_s']:.1f} tok/s "
                     f"= {sp['spec_decode_tok_s'] / res['decode_tok_s']:.2f}x plain; acceptance "
                     f"{100 * (sp['spec_accept_rate'] or 0):.1f}%, {sp['spec_tokens_per_round'] or 0:.2f} "
                     f"tokens/round; greedy output identical to plain: {sp['spec_identical_to_plain']}")
    if res.get("cudagraph_skips"):
        lines.append(f"  WARNING: Inductor skipped CUDA graphs {res['cudagraph_skips']} time(s) (see the log)")
    if "kernels_per_step" in res:
        lines.append(f"  profile  {res['kernels_per_step']:10.1f} kernels/step, GPU busy "
                     f"{res['gpu_ms_per_step']:.3f} ms/step")
    if res["custom_ops"]:
        lines.append("  custom ops: " + ", ".join(f"{k} x{v}" for k, v in res["custom_ops"].items()))
    if res.get("cpu_traced_ops"):
        lines.append("  CPU aten forms: " + ", ".join(f"{k} x{v}" for k, v in res["cpu_traced_ops"].items()))
    return "\n".join(lines)
