"""GPU benchmark: the fused RMSNorm + BitLinear Triton kernels against bf16 F.linear (+ a separate
RMSNorm where the BitLinear absorbs one), at SmolLM2-135M, Llama-3.2-1B and Llama-2-7B layer shapes.

Per model, the four BitLinear ops of one decoder layer as the `bitlinear` pass emits them:
  qkv      rms_norm_bitlinear  hidden -> q + k + v     vs rms_norm + F.linear (concatenated bf16)
  o        bitlinear           q      -> hidden        vs F.linear
  gate_up  rms_norm_bitlinear  hidden -> 2 x inter     vs rms_norm + F.linear
  down     bitlinear           inter  -> hidden        vs F.linear
Times are CUDA-graph replays (launch overhead excluded, as in a captured decode step), median
of triton.testing's runs; "rms_norm" is torch's fused F.rms_norm where present. GB/s counts the
bytes the BitLinear kernel must read (2-bit weights, scales, x, norm weight) and write, "of
copy" is that over the copy bandwidth measured at the start (torch's copy of 1 GiB: bytes read +
written over time). `us_tc` is the tensor-core kernel's default tiling at the same rows (what
decode rows ran before the dp4a GEMV). A small sweep of tensor-core decode tilings reports the
best next to the default. Each shape is checked against the reference first.

Usage: python scripts/gpu_bitlinear_bench.py [--batch 1 16] [--no-sweep]
JSON goes to $OUT/bitlinear_bench.json if $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

MODELS = {  # hidden, q size, kv size (k and v each), intermediate
    "smollm2-135m": (576, 576, 192, 1536),
    "llama-1b": (2048, 2048, 512, 8192),
    "llama2-7b": (4096, 4096, 4096, 11008),
}


def copy_bandwidth() -> float:
    a = torch.empty(1 << 29, device="cuda", dtype=torch.float16)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * a.element_size() / bench(lambda: b.copy_(a))
SWEEP = [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=nw)
         for bn in (16, 32, 64) for bk in (256, 512) for sk in (1, 2, 4, 8) for nw in (4,)]


def bench(fn) -> float:
    """Median seconds per call."""
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    if hasattr(tt, "do_bench_cudagraph"):
        ms = tt.do_bench_cudagraph(fn, rep=50)
    else:
        ms = tt.do_bench(fn, warmup=25, rep=100)
    return ms * 1e-3


def layer_ops(hidden, q, kv, inter):
    """(name, K, N, fused) of one layer's BitLinear ops."""
    return [("qkv", hidden, q + 2 * kv, True), ("o", q, hidden, False),
            ("gate_up", hidden, 2 * inter, True), ("down", inter, hidden, False)]


def rms(x, w, eps=1e-5):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    from llmaccel import ops
    return ops.rms_norm(x, w, eps=eps)


def run_op(kb, bo, M, K, N, fused, sweep, copy_bw):
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=dt)
    nw = (torch.rand(K, device=dev) + 0.5).to(dt)
    w = torch.randn(N, K, device=dev, dtype=dt) * 0.02
    t, s = bo.ternarize(w, "per_tensor")
    p, s = bo.pack_ternary(t), s.to(dt)
    kw = dict(in_features=K, out_features=N)
    if fused:
        kw_n = dict(norm_weight=nw, eps=1e-5)
        ours = lambda cfg=None: kb.bitlinear_triton(x, p, s, None, config=cfg, **kw, **kw_n)  # noqa: E731
        base = lambda: F.linear(rms(x, nw), w)  # noqa: E731
        ref = bo.rms_norm_bitlinear(x, nw, p, s, None, eps=1e-5, **kw)
    else:
        ours = lambda cfg=None: kb.bitlinear_triton(x, p, s, None, config=cfg, **kw)  # noqa: E731
        base = lambda: F.linear(x, w)  # noqa: E731
        ref = bo.bitlinear(x, p, s, None, **kw)
    err = ((ours().float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    t_ours, t_base = bench(ours), bench(base)
    tc_cfg = kb.default_config(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count)
    t_tc = bench(lambda: ours(dict(tc_cfg)))
    best_cfg, t_best = None, t_ours
    if sweep and M <= kb.GEMV_MAX_M:
        for cfg in SWEEP:
            try:
                tc = bench(lambda: ours(dict(cfg)))
            except Exception:  # a tiling the compiler rejects (registers, shared memory)
                continue
            if tc < t_best:
                best_cfg, t_best = cfg, tc
    nbytes = p.numel() + s.numel() * 2 + x.numel() * 2 + M * N * 2 + (K * 2 if fused else 0)
    return {"M": M, "K": K, "N": N, "fused": fused, "max_rel_err": err,
            "us_bitlinear": t_ours * 1e6, "us_bf16": t_base * 1e6,
            "speedup": t_base / t_ours, "gbps": nbytes / t_ours / 1e9,
            "of_copy": nbytes / t_ours / copy_bw, "us_tc": t_tc * 1e6, "tc_config": tc_cfg,
            "best_config": best_cfg, "us_best": t_best * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--no-sweep", action="store_true")
    a = ap.parse_args()
    from llmaccel.kernels import bitlinear as kb
    from llmaccel.ops import bitlinear as bo

    torch.manual_seed(0)
    rows = []
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(f"{'model':13} {'op':8} {'M':>3} {'KxN':>12} {'bitlin us':>9} {'bf16 us':>8} "
          f"{'speedup':>7} {'GB/s':>6} {'copy%':>5} {'tc us':>7} {'best us':>8} {'relerr':>8}")
    for model, shape in MODELS.items():
        for M in a.batch:
            tot_ours = tot_base = 0.0
            for name, K, N, fused in layer_ops(*shape):
                r = run_op(kb, bo, M, K, N, fused, not a.no_sweep, copy_bw)
                r.update(model=model, op=name)
                rows.append(r)
                tot_ours += r["us_bitlinear"]
                tot_base += r["us_bf16"]
                print(f"{model:13} {name:8} {M:3d} {f'{K}x{N}':>12} {r['us_bitlinear']:9.2f} "
                      f"{r['us_bf16']:8.2f} {r['speedup']:7.2f} {r['gbps']:6.0f} "
                      f"{100 * r['of_copy']:5.1f} {r['us_tc']:7.2f} {r['us_best']:8.2f} "
                      f"{r['max_rel_err']:8.1e}")
            print(f"{model:13} {'layer':8} {M:3d} {'':>12} {tot_ours:9.2f} {tot_base:8.2f} "
                  f"{tot_base / tot_ours:7.2f}")
    out = os.environ.get("OUT")
    if out:
        path = os.path.join(out, "bitlinear_bench.json")
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": copy_bw, "rows": rows}, f,
                      indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
