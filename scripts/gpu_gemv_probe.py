"""Fused decode GEMV (llmaccel::gemv) tilings against cuBLAS on the GPU, and a decode-layer chain
with and without programmatic dependent launch.

Single GEMVs: a CUDA graph of calls cycling over weight copies (more bytes than L2 holds;
scripts/gpu_quant_bench.py's timer), microseconds per call and TB/s of weight read, for cuBLAS
F.linear and the Triton kernel at several weights-per-program and warps (without PDL, then the
best tiling with PDL: back-to-back independent GEMVs overlap). Chain: llama-1b's 16 layers of
qkv (norm inside), o (+ residual), gate/up (norm inside, SiLU-mul), down (+ residual), each
reading the one before, as in a decode step without its attention.

    PYTHONPATH=$PWD python scripts/gpu_gemv_probe.py --out $OUT/gemv_probe.json
    PYTHONPATH=$PWD python scripts/gpu_gemv_probe.py --out $OUT/chains.json --shapes '' --chains smol,1b,7b --sweep
    PYTHONPATH=$PWD python scripts/gpu_gemv_probe.py --out $OUT/int4.json --shapes '' --chains '' --int4 1b --sweep

--int4: the same chains with W4 g128 weights (llmaccel::gemv_int4 at several words per program
and warps, and linear_int4's kernels with the norms, SiLU-mul and adds apart), and the int4 LM
head (128256 x 2048) alone: gemv_int4 against linear_int4.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from llmaccel.kernels.gemv import gemv_int4_triton, gemv_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_quant_bench import time_graph  # noqa: E402

SHAPES = {  # name: (N, K, glu)
    "1b.qkv": (3072, 2048, False), "1b.o": (2048, 2048, False), "1b.gate_up": (16384, 2048, True),
    "1b.down": (2048, 8192, False),
    "smol.qkv": (960, 576, False), "smol.o": (576, 576, False), "smol.gate_up": (3072, 576, True),
    "smol.down": (576, 1536, False),
    "7b.qkv": (12288, 4096, False), "7b.o": (4096, 4096, False), "7b.gate_up": (22016, 4096, True),
    "7b.down": (4096, 11008, False),
}
TILES = [(e, w) for e in (4096, 8192, 16384, 32768) for w in (4, 8)]


def single(name, N, K, glu, bw):
    nbytes = N * K * 2
    copies = max(2, -(-(400 << 20) // nbytes))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    res = {"shape": [N, K], "glu": glu, "MB": nbytes / 1e6}

    def rate(s):
        return {"us": round(s * 1e6, 2), "TBs": round(nbytes / s / 1e12, 3), "frac": round(nbytes / s / bw, 3)}

    res["cublas"] = rate(time_graph(lambda i: (lambda: F.linear(x, ws[i])), copies))
    best = None
    for elems, warps in TILES:
        try:
            s = time_graph(lambda i: (lambda: gemv_triton(x, ws[i], glu=glu, elems=elems, num_warps=warps,
                                                          pdl=False)), copies)
        except Exception as e:  # a tiling that does not compile: recorded, not fatal
            res[f"e{elems}w{warps}"] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        res[f"e{elems}w{warps}"] = rate(s)
        if best is None or s < best[0]:
            best = (s, elems, warps)
    if best is not None:
        _, elems, warps = best
        res["best"] = f"e{elems}w{warps}"
        res["best_pdl"] = rate(time_graph(lambda i: (lambda: gemv_triton(
            x, ws[i], glu=glu, elems=elems, num_warps=warps, pdl=True)), copies))
    print(f"{name:<14}{nbytes / 1e6:>7.1f} MB  cublas {res['cublas']['us']:>7.2f} us "
          f"({res['cublas']['frac']:.0%})  best {res.get('best')}: "
          f"{res[res['best']]['us'] if best else float('nan'):>7.2f} us "
          f"({res[res['best']]['frac'] if best else 0:.0%})  +pdl "
          f"{res['best_pdl']['us'] if best else float('nan'):>7.2f} us", flush=True)
    del ws
    torch.cuda.empty_cache()
    return res


def time_chains(runs, nbytes, bw, name):
    """{label: us, TB/s and fraction of bw (or the error)} for each (label, step) in runs: a step
    reading nbytes of weights, timed as a CUDA graph (a tiling that fails is recorded, not fatal)."""
    out = {}
    for label, fn in runs:
        try:
            s = time_graph(lambda i, fn=fn: fn, 1)
        except Exception as e:
            out[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{name} {label}: {out[label]['error']}", flush=True)
            continue
        out[label] = {"us": round(s * 1e6, 1), "TBs": round(nbytes / s / 1e12, 3), "frac": round(nbytes / s / bw, 3)}
        print(f"{name} {label:<20} {s * 1e6:8.1f} us  {nbytes / s / 1e12:.2f} TB/s ({nbytes / s / bw:.0%})",
              flush=True)
    return out


MODELS = {"smol": (576, 960, 1536, 30), "1b": (2048, 3072, 8192, 16), "7b": (4096, 12288, 11008, 32)}


def chain(bw, model="1b", tiles=((None, None),), cublas=True):
    """A model's layers without attention: one step's linears, fused, each reading the one
    before; with PDL for each (weights per program, warps) in tiles (None: the op's own), once
    without PDL at the op's tiling, and cuBLAS GEMVs alone."""
    H, QKV, I, L = MODELS[model]
    torch.manual_seed(0)
    layers = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
               for n, k in ((QKV, H), (H, H), (2 * I, H), (H, I))] for _ in range(L)]
    nbytes = sum(w.numel() * 2 for ly in layers for w in ly)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    out = {"MB": nbytes / 1e6}

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count

    def fused(pdl, elems, warps, pps=None):
        kw = dict(pdl=pdl, num_warps=warps, **({"elems": elems} if elems else {}))
        if pps:
            kw["programs"] = pps * n_sm

        def step():
            h = x
            for wq, wo, wgu, wd in layers:
                a = gemv_triton(h, wq, eps=1e-5, **kw)[:, :H]
                h = gemv_triton(a, wo, residual=h, **kw)
                m = gemv_triton(h, wgu, eps=1e-5, glu=True, **kw)
                h = gemv_triton(m, wd, residual=h, **kw)
            return h
        return step

    def cublas_step():
        h = x
        for wq, wo, wgu, wd in layers:
            a = F.linear(h, wq)[:, :H]
            h = F.linear(a, wo)
            m = F.linear(h, wgu)[:, :I]
            h = F.linear(m, wd)
        return h

    runs = [(f"pdl_e{e}w{w}" + (f"p{p}" if p else ""), fused(True, e, w, p)) for e, w, *p_ in tiles
            for p in [p_[0] if p_ else None]] + [("nopdl", fused(False, None, None))]
    if cublas:
        runs.append(("cublas_gemvs_only", cublas_step))
    out.update(time_chains(runs, nbytes, bw, f"chain {model}"))
    del layers
    torch.cuda.empty_cache()
    return out


def int4_weights(n, k, gs=128):
    from llmaccel.ops.quant import pack_int4, pack_zeros

    G = -(-k // gs)
    q = torch.randint(0, 16, (n, G, gs), device="cuda")
    z = torch.randint(0, 16, (n, G), device="cuda")
    s = (torch.rand(n, G, device="cuda") + 0.5) * (2.0 / (15 * k ** 0.5))
    return pack_int4(q), s.bfloat16(), pack_zeros(z)


def int4_bytes(w):
    return sum(t.numel() * t.element_size() for t in w)


def chain_int4(bw, model="1b", tiles=((None, None),), gs=128):
    """chain() with W4 weights: gemv_int4 (PDL) per (words, warps), without PDL, and the
    quantization issue's linear_int4 with the RMSNorm / SiLU-mul / residual adds as torch ops."""
    from llmaccel import ops
    from llmaccel.kernels.quant_linear import linear_int4_triton

    H, QKV, I, L = MODELS[model]
    torch.manual_seed(0)
    layers = [[int4_weights(n, k, gs) for n, k in ((QKV, H), (H, H), (2 * I, H), (H, I))] for _ in range(L)]
    nbytes = sum(int4_bytes(w) for ly in layers for w in ly)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    out = {"MB": nbytes / 1e6}

    def fused(pdl, words, warps, pps=None):
        kw = dict(pdl=pdl, num_warps=warps, group_size=gs, **({"words": words} if words else {}))
        if pps:
            kw["programs"] = pps * n_sm

        def step():
            h = x
            for wq, wo, wgu, wd in layers:
                a = gemv_int4_triton(h, *wq, eps=1e-5, **kw)[:, :H]
                h = gemv_int4_triton(a, *wo, residual=h, **kw)
                m = gemv_int4_triton(h, *wgu, eps=1e-5, glu=True, **kw)
                h = gemv_int4_triton(m, *wd, residual=h, **kw)
            return h
        return step

    def unfused():
        h = x
        for wq, wo, wgu, wd in layers:
            a = linear_int4_triton(ops.rms_norm(h, None, eps=1e-5), *wq, group_size=gs)[:, :H]
            h = h + linear_int4_triton(a, *wo, group_size=gs)
            m = linear_int4_triton(ops.rms_norm(h, None, eps=1e-5), *wgu, group_size=gs)
            h = h + linear_int4_triton(ops.silu_mul(*m.chunk(2, -1)), *wd, group_size=gs)
        return h

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    runs = [(f"pdl_w{e}w{w}p{p}", fused(True, e, w, p)) for e, w, p in tiles] + \
        [("nopdl", fused(False, None, None)), ("linear_int4_unfused", unfused)]
    out.update(time_chains(runs, nbytes, bw, f"chain int4 {model}"))
    del layers
    torch.cuda.empty_cache()
    return out


def head_int4(bw, tiles, gs=128, n=128256, k=2048):
    """The int4 LM head alone (CUDA graph cycling over copies): gemv_int4 per tiling (norm
    inside) and linear_int4."""
    from llmaccel.kernels.quant_linear import linear_int4_triton

    w0 = int4_weights(n, k, gs)
    nbytes = int4_bytes(w0)
    copies = max(2, -(-(400 << 20) // nbytes))
    ws = [w0] + [int4_weights(n, k, gs) for _ in range(copies - 1)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = {"MB": nbytes / 1e6}
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    runs = [(f"w{e}w{w}p{p}", lambda i, e=e, w=w, p=p: (lambda: gemv_int4_triton(
        x, *ws[i], group_size=gs, eps=1e-5, words=e, num_warps=w, pdl=False,
        programs=p and p * n_sm))) for e, w, p in tiles]
    runs.append(("linear_int4", lambda i: (lambda: linear_int4_triton(x, *ws[i], group_size=gs))))
    for label, make in runs:
        try:
            s = time_graph(make, copies)
        except Exception as e:
            out[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        out[label] = {"us": round(s * 1e6, 2), "TBs": round(nbytes / s / 1e12, 3), "frac": round(nbytes / s / bw, 3)}
        print(f"head int4 {label:<14} {s * 1e6:8.2f} us  ({nbytes / s / bw:.0%})", flush=True)
    del ws
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="single GEMVs ('' for none)")
    ap.add_argument("--chains", default="1b", help="models whose layer chain runs")
    ap.add_argument("--sweep", action="store_true", help="chains at several tilings with PDL")
    ap.add_argument("--int4", default="", help="models whose W4 layer chain runs (and the int4 LM head)")
    ap.add_argument("--persist", action="store_true",
                    help="bf16 chains with persistent programs (1, 2, 4, 8 per SM) at a few tilings")
    a = ap.parse_args()
    from llmaccel.bench.run import copy_bandwidth

    bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    res = {"device": torch.cuda.get_device_name(), "copy_TBs": bw / 1e12, "single": {}}
    for name in filter(None, a.shapes.split(",")):
        res["single"][name] = single(name, *SHAPES[name], bw)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    tiles = [(e, w) for e in (2048, 4096, 8192, 16384) for w in (2, 4, 8)] if a.sweep else [(None, None)]
    if a.persist:
        tiles = [(None, None)] + [(e, w, p) for e in (4096, 8192) for w in (4, 8) for p in (1, 2, 4, 8)]
    res["chain"] = {}
    for m in filter(None, a.chains.split(",")):
        res["chain"][m] = chain(bw, m, [(None, None), *tiles] if a.sweep and not a.persist else tiles)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if a.int4:
        t4 = [(w, n, p) for w in (1024, 2048, 4096) for n in (4, 8) for p in (1, 2, 4)] if a.sweep else []
        res["int4"] = {"head": head_int4(bw, [(None, None, None), *t4])}
        for m in filter(None, a.int4.split(",")):
            res["int4"][m] = chain_int4(bw, m, [(None, None, None), *t4])
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
