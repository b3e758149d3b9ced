"""GPU benchmark: int4 / int8 weight-only linear kernels against bf16 F.linear at decode batches.

Llama-3.2-1B matrices (K in x N out) as the engine runs them after `fuse`: 2048x16384 (gate_up),
2048x3072 (qkv), 8192x2048 (down), 2048x2048 (o), 2048x128256 (LM head); batches 1, 4, 16, 64. Each case first checks the default
kernels against the reference (dequantize, then matmul in fp32), then times, per call:
bf16 F.linear, int4 and int8 with the default tiles, and (sweep) every candidate tiling, keeping
the best. Timing: one CUDA graph of many calls (launch overhead excluded, as in a captured decode
step), median of replays; the calls rotate over copies of the weights spanning >= 128 MB, so
every call reads its weights from HBM, not from the 50 MB L2. GB/s counts the bytes each kernel
must read (weights, scales, zeros, x) and write; "%" is that over the H200's 4.27 TB/s copy
bandwidth (the copy bandwidth measured in this run is printed too).
Goal (issue 3): int4 at batch 1 >= 3x bf16 and >= 70% of copy bandwidth; int8 ~1.8x bf16.

Usage: python scripts/gpu_quant_bench.py [--no-sweep] [--budget 130] [--batches 1,4,16]
       [--ops int4,int8]   (short batch-1 int4 re-run: --batches 1 --budget 90 --ops int4)
Prints the table last and `TUNED[device][...] = ...` lines for llmaccel/kernels/quant_linear_configs.py; the full
JSON goes to $OUT/quant_bench.json when OUT is set. Runs in under ~3 minutes on the H200 (the
sweep stops at --budget seconds; batch 1 is swept first).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

COPY_BW = 4.27e12
# (K, N): the fused shapes, since TUNED is keyed by shape and a tile tuned for unfused gate or
# q never applies to the fused linears the decode step runs
SHAPES = [(2048, 16384), (2048, 3072), (8192, 2048), (2048, 128256), (2048, 2048)]
ROTATE_BYTES = 128 << 20


def gemv4(bn, bg, unpack, nw, split=1, stages=1) -> dict:
    cfg = dict(kernel="gemv", BLOCK_N=bn, BLOCK_G=bg, UNPACK=unpack, SPLIT_K=split, num_warps=nw)
    return dict(cfg, STAGES=stages) if stages > 1 else cfg


# best gemv tilings of run 1 (H200) at batch 1: (BLOCK_N, BLOCK_G, UNPACK, num_warps)
GOOD_BS1 = [(4, 16, 0, 4), (16, 8, 1, 4), (8, 16, 0, 8), (8, 4, 0, 1), (4, 8, 1, 1)]


def int4_bs1_candidates(N: int, K: int, gs: int, n_sm: int = 132) -> list:
    """Batch 1, likeliest first. Run 1 left the long-K / few-program cases latency-bound (one
    8 KB tile in flight per program, 1.3 waves), so: split-K (more programs, each fewer steps),
    a pipelined K loop (STAGES: cp.async keeps STAGES - 1 tiles in flight), UNPACK=2 (zero point
    folded into the dequantizing FMA, no per-step cross-thread reductions), and the tensor-core
    kernel with small tiles (1-2 warps, many programs per SM)."""
    G = -(-K // gs)
    good = [(bn, min(bg, 1 << max(0, (G - 1).bit_length())), u, nw) for bn, bg, u, nw in GOOD_BS1]
    out = [gemv4(*t) for t in good[:3]]
    # XPERM: x loaded as vectors and permuted on chip, not gathered (sm_90 SASS: 5.9-6.6
    # instructions per weight byte against 7.1-11.6 gathered, and x gets cp.async-pipelined)
    # SERIAL: split-K in one launch (last program of a tile reduces), not memset + atomics + cast
    out += [dict(kernel="dotasm", BLOCK_M=16, BLOCK_N=bn, BLOCK_G=1, SPLIT_K=split, num_warps=nw,
                 num_stages=3, XPERM=True, **({"SERIAL": True} if split > 1 else {}))
            for bn, nw in ((128, 4), (64, 2), (32, 1)) for split in (1, 2, 4, 8)
            if split == 1 or N // bn < 2 * n_sm]
    for bn, bg, u, nw in good:
        for split in (2, 4, 8):
            progs = -(-N // bn)
            if G // (bg * split) >= 1 and progs < 4 * n_sm and progs * split <= 32 * n_sm:
                out.append(dict(gemv4(bn, bg, u, nw, split), SERIAL=True))
    for bn, bg, u, nw in good:
        for split in (1, 2, 4):
            if G // (bg * split) >= 4 and (split == 1 or -(-N // bn) < 4 * n_sm):
                out.append(dict(gemv4(bn, bg, u, nw, split, stages=3),
                                **({"SERIAL": True} if split > 1 else {})))
    out += [gemv4(bn, bg, 2, nw) for bn, bg, _, nw in good]
    out += [dict(kernel="dotasm", BLOCK_M=16, BLOCK_N=bn, BLOCK_G=1, SPLIT_K=split, num_warps=nw,
                 num_stages=3, PREFETCH=False)
            for bn, nw in ((32, 1), (64, 2), (128, 4), (64, 1)) for split in (1, 2, 4, 8)
            if split == 1 or N // bn < 2 * n_sm]
    out += [gemv4(bn, bg, u, nw, stages=4) for bn, bg, u, nw in good if G // bg >= 8]
    out += [dict(c, SERIAL=False) for c in out if c.get("SERIAL")]   # the memset + atomics form
    return out


def row_tiles(M: int) -> tuple[int, ...]:
    """Rows per tile to try: 16 up to 16 rows; for 17-64, one tile of all rows (each code
    dequantized once), then 32 and 16."""
    return (16,) if M <= 16 else (min(64, 1 << (M - 1).bit_length()), 32, 16)


def int4_candidates(M: int, N: int, K: int = 2048, gs: int = 128) -> list:
    """Tilings to try, the likeliest first (fewest sm_90 instructions per weight byte without
    spills), so that the time budget cuts the least promising."""
    # bf16-only tensor-core kernel with PTX dequantization (fewest instructions per byte in
    # sm_90 SASS: ~7 at BLOCK_N=128, 4 warps); few rows per program need split-K for small N.
    # PREFETCH lost everywhere in run 1: last.
    bms = row_tiles(M)
    asm = [dict(kernel="dotasm", BLOCK_M=bm, BLOCK_N=bn, BLOCK_G=1, SPLIT_K=split,
                num_warps=max(nw, bm // 16), num_stages=3, PREFETCH=pf)
           for pf in (False, True) for bm in bms for bn, nw in ((128, 4), (64, 2), (256, 8), (128, 8), (64, 4))
           for split in (1, 2, 4, 8) if split == 1 or (N // bn) * -(-M // bm) < 264]
    asm = [dict(c, XPERM=True) for c in asm if not c["PREFETCH"]] + \
        [c for c in asm if not c["PREFETCH"]] + [c for c in asm if c["PREFETCH"]]
    out = []
    if M <= 4:
        for wpt in (16, 8):  # int32 words per thread
            for unpack in (1, 0):
                for bn in (16, 8, 4):
                    for bg in (8, 16, 4):
                        nw = bn * bg * 16 // (32 * wpt)
                        if 1 <= nw <= 8 and (M == 1 or (bn <= 8 and unpack == 1)):
                            out.append(dict(kernel="gemv", BLOCK_N=bn, BLOCK_G=bg, UNPACK=unpack,
                                            SPLIT_K=1, num_warps=nw))
        if N <= 2048:
            out[6:6] = [dict(c, SPLIT_K=s) for c in out[:6] for s in (2, 4)]
    if M == 1:
        first = int4_bs1_candidates(N, K, gs)
        return first + [c for c in asm + out if c not in first]
    if M > 1:
        dots = []
        for bm in bms[:2]:
            for bn in (16, 32, 64):
                for bg in (2, 1, 4):
                    for split in (1, 2, 4):
                        if split == 1 or N <= 4096:
                            dots.append(dict(kernel="dot", BLOCK_M=bm, BLOCK_N=bn, BLOCK_G=bg,
                                             SPLIT_K=split, num_warps=4, num_stages=3))
        out = dots + out
    return asm + out


def int8_candidates(M: int, N: int) -> list:
    out = []
    if M <= 4:
        for wpt in (16, 8):
            for unpack in (0, 1):
                for bn in (8, 16, 4):
                    for bw in (256, 512):
                        nw = bn * bw // (32 * wpt)
                        if 1 <= nw <= 8 and (M == 1 or unpack == 0):
                            out.append(dict(kernel="gemv", BLOCK_N=bn, BLOCK_W=bw, UNPACK=unpack,
                                            SPLIT_K=1, num_warps=nw))
    if M > 1:
        out = [dict(kernel="dot", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3)
               for bm in row_tiles(M) for bn in (16, 32, 64) for bk in (128, 64, 256)] + out
    return out


def time_graph(make_call, copies: int) -> float:
    """Seconds per call: a CUDA graph of n calls cycling over the weight copies, median of 5."""
    calls = max(copies, 20)
    make_call(0)()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(copies, 3)):
            make_call(i)()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    fns = [make_call(i % copies) for i in range(calls)]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    from llmaccel.bench.run import cuda_time_us  # the one GPU timer (events, median)

    return cuda_time_us(g.replay, reps=5, warmup=1) * 1e-6 / calls


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def rel_err(got, exp) -> float:
    return ((got.float() - exp.float()).abs().max() / exp.float().abs().max()).item()


def copy_bw() -> float:
    a = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / time_graph(lambda i: (lambda: b.copy_(a)), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--budget", type=float, default=130.0, help="seconds for the whole sweep")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--ops", default="int4,int8", help="which ops to sweep (both are timed)")
    a = ap.parse_args()
    from llmaccel.kernels import quant_linear as ql
    from llmaccel.kernels import quant_linear_int8 as q8
    from llmaccel.ops import quant as ref

    t_start = time.time()
    torch.manual_seed(0)
    gs = a.group_size
    bw_copy = copy_bw()
    weights = {}
    for K, N in SHAPES:
        G = K // gs
        one = lambda: dict(  # noqa: E731
            w=torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02,
            qw=torch.randint(0, 256, (N, G, gs // 2), dtype=torch.uint8, device="cuda"),
            sc=(torch.rand(N, G, device="cuda") * 0.01).to(torch.bfloat16),
            zr=torch.randint(0, 256, (N, (G + 1) // 2), dtype=torch.uint8, device="cuda"),
            q8=torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda"),
            s8=(torch.rand(N, device="cuda") * 0.01).to(torch.bfloat16))
        weights[(K, N)] = one()
    rows, failures = [], []
    batches = [int(b) for b in a.batches.split(",")]
    shares = [2.0 if M == 1 else 1.0 for M in batches]   # batch 1 is the goal: twice the time
    for j, M in enumerate(batches):
        left = max(0.0, a.budget - (time.time() - t_start))   # unused time carries over
        batch_deadline = time.time() + left * shares[j] / sum(shares[j:])
        for i_shape, (K, N) in enumerate(SHAPES):
            # each shape gets an equal part of what is left of its batch's time
            deadline = time.time() + max(0.0, batch_deadline - time.time()) / (len(SHAPES) - i_shape)
            W = weights[(K, N)]
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            b_bf16 = nbytes(W["w"]) + nbytes(x) + M * N * 2
            b_int4 = nbytes(W["qw"], W["sc"], W["zr"], x) + M * N * 2
            b_int8 = nbytes(W["q8"], W["s8"], x) + M * N * 2

            def copies_of(nb, keys):
                r = max(1, min(256, -(-ROTATE_BYTES // nb)))
                return [W] + [{k: W[k].clone() for k in keys} for _ in range(r - 1)]

            c_bf16 = copies_of(b_bf16, ["w"])
            c_int4 = copies_of(b_int4, ["qw", "sc", "zr"])
            c_int8 = copies_of(b_int8, ["q8", "s8"])
            exp4 = ref.linear_int4(x.float(), W["qw"], W["sc"].float(), W["zr"], group_size=gs)
            exp8 = ref.linear_int8(x.float(), W["q8"], W["s8"].float())

            def int4_call(cfg):
                return lambda i: (lambda: ql.linear_int4_triton(
                    x, c_int4[i]["qw"], c_int4[i]["sc"], c_int4[i]["zr"], group_size=gs, config=cfg))

            def int8_call(cfg):
                return lambda i: (lambda: q8.linear_int8_triton(x, c_int8[i]["q8"], c_int8[i]["s8"],
                                                                config=cfg))

            dev = torch.cuda.get_device_name(x.device)
            d4 = ql.int4_config(M, N, K, gs, ql.sm_count(x.device), asm=ql._asm_works(ql.device_index(x.device)), device=dev)
            d8 = ql.int8_config(M, N, K, ql.sm_count(x.device), dev)
            err4 = rel_err(ql.linear_int4_triton(x, W["qw"], W["sc"], W["zr"], group_size=gs), exp4)
            err8 = rel_err(q8.linear_int8_triton(x, W["q8"], W["s8"]), exp8)
            t_bf16 = time_graph(lambda i: (lambda: F.linear(x, c_bf16[i]["w"])), len(c_bf16))
            t4 = time_graph(int4_call(None), len(c_int4))
            t8 = time_graph(int8_call(None), len(c_int8))
            best4, best8 = (t4, d4), (t8, d8)
            sweep4, sweep8 = [], []
            if not a.no_sweep:
                for op, cands, call, exp, copies, sweep in (
                        ("int4", int4_candidates(M, N, K, gs), int4_call, exp4, c_int4, sweep4),
                        ("int8", int8_candidates(M, N), int8_call, exp8, c_int8, sweep8)):
                    for cfg in cands:
                        if op not in a.ops.split(",") or time.time() > deadline:
                            break
                        try:
                            e = rel_err(call(cfg)(0)(), exp)
                            if not e < 2e-2:
                                failures.append(dict(op=op, shape=f"{K}x{N}", batch=M, config=cfg, err=e))
                                continue
                            t = time_graph(call(cfg), len(copies))
                        except Exception as ex:  # a tiling that does not compile or fit: skip it
                            failures.append(dict(op=op, shape=f"{K}x{N}", batch=M, config=cfg,
                                                 error=f"{type(ex).__name__}: {str(ex)[:200]}"))
                            continue
                        sweep.append(dict(config=cfg, us=t * 1e6))
                        if op == "int4" and t < best4[0]:
                            best4 = (t, cfg)
                        if op == "int8" and t < best8[0]:
                            best8 = (t, cfg)
            rows.append(dict(
                shape=f"{K}x{N}", K=K, N=N, batch=M, max_rel_err_int4=err4, max_rel_err_int8=err8,
                bf16_us=t_bf16 * 1e6, int4_us=t4 * 1e6, int8_us=t8 * 1e6,
                int4_best_us=best4[0] * 1e6, int4_best_config=best4[1], int4_default_config=d4,
                int8_best_us=best8[0] * 1e6, int8_best_config=best8[1], int8_default_config=d8,
                bytes_bf16=b_bf16, bytes_int4=b_int4, bytes_int8=b_int8,
                int4_sweep=sweep4, int8_sweep=sweep8))
            del c_bf16, c_int4, c_int8
            torch.cuda.empty_cache()

    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "quant_bench.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw_ref": COPY_BW,
                       "copy_bw_measured": bw_copy, "group_size": gs, "rows": rows,
                       "failures": failures, "seconds": time.time() - t_start}, f, indent=1)
    for fl in failures[:20]:
        print("failed:", fl)
    print(f"\n# paste into llmaccel/kernels/quant_linear.py (best measured tiles, "
          f"{torch.cuda.get_device_name()})")
    for r in rows:
        for op in ("int4", "int8"):
            cfg = r[f"{op}_best_config"]
            key = (op, r["N"], r["K"], gs if op == "int4" else 0, r["batch"])
            print(f"TUNED[{torch.cuda.get_device_name()!r}][{key!r}] = {cfg!r}")
    print(f"\n{torch.cuda.get_device_name()}, CUDA-graph timings, weights cold in L2; "
          f"% = of 4.27 TB/s (copy measured here: {bw_copy / 1e12:.2f} TB/s); "
          f"x = speedup over bf16; int4 g{gs}; {time.time() - t_start:.0f} s")
    print(f"{'K x N':>12} {'M':>3} | {'bf16 us':>7} {'%':>3} | {'int4 us':>7} {'x':>5} {'%':>3} | "
          f"{'best us':>7} {'x':>5} {'%':>3} | {'int8 us':>7} {'x':>5} {'%':>3} | "
          f"{'best us':>7} {'x':>5} {'%':>3} | err4    err8")
    for r in rows:
        def cols(us, nb):
            return f"{us:7.2f} {r['bf16_us'] / us:5.2f} {100 * nb / (us * 1e-6) / COPY_BW:3.0f}"
        print(f"{r['shape']:>12} {r['batch']:>3} | {r['bf16_us']:7.2f} "
              f"{100 * r['bytes_bf16'] / (r['bf16_us'] * 1e-6) / COPY_BW:3.0f} | "
              f"{cols(r['int4_us'], r['bytes_int4'])} | {cols(r['int4_best_us'], r['bytes_int4'])} | "
              f"{cols(r['int8_us'], r['bytes_int8'])} | {cols(r['int8_best_us'], r['bytes_int8'])} | "
              f"{r['max_rel_err_int4']:.1e} {r['max_rel_err_int8']:.1e}")


if __name__ == "__main__":
    main()
