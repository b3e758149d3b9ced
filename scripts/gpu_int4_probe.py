"""GPU probe: how close can a batch-1 int4 GEMV get to the bandwidth on Llama-1B matrices?

For each shape (K in x N out) at batch 1 it times, in CUDA graphs with the weights rotated over
copies spanning >= 128 MB (cold in L2, as scripts/gpu_quant_bench.py does):
  * bf16 F.linear (cuBLAS), the ratio's baseline;
  * torch's copy of a buffer of the int4 weight bytes (packed codes + scales + zeros): the copy
    bandwidth reachable at that size in one launch;
  * a Triton kernel that only reads the packed words, with the GEMV's row tiling (floor for any
    Triton kernel that must read those bytes);
  * linear_int4 with its default tiles (tiling sweeps: scripts/gpu_quant_bench.py).
--ncu CASE runs a few launches of one case for Nsight Compute instead (see scripts/gpu_checks.sh).

Usage: python scripts/gpu_int4_probe.py [--shapes 2048x8192,8192x2048,2048x128256]
Prints a table last; full JSON to $OUT/int4_probe.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_quant_bench import COPY_BW, ROTATE_BYTES, nbytes, rel_err, time_graph  # noqa: E402


@triton.jit
def _read_kernel(w_ptr, out_ptr, N, KW, WPS, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                 STAGES: tl.constexpr):
    """Sums each row's int32 words over this program's K range: the loads of a GEMV, no math."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32)
    lo = pid_k * WPS
    for w0 in tl.range(lo, lo + WPS, BLOCK_W, num_stages=STAGES):
        acc += tl.load(w_ptr + rn[:, None] * KW + (w0 + rw)[None, :])
    tl.store(out_ptr + pid_k * N + rn, tl.sum(acc, axis=1))


def read_configs(N: int, KW: int) -> list:
    out = []
    for bn, bw, nw in ((4, 256, 2), (8, 256, 4), (16, 256, 8), (8, 128, 2), (32, 128, 8)):
        for split in (1, 2, 4):
            if KW % (bw * split) == 0 and N % bn == 0:
                for st in (1, 3):
                    if st == 1 or KW // (bw * split) >= 2:
                        out.append(dict(BLOCK_N=bn, BLOCK_W=bw, SPLIT=split, num_warps=nw, STAGES=st))
    return out


def shape_list(s: str) -> list:
    return [tuple(int(v) for v in p.split("x")) for p in s.split(",")]


def weights(K, N, gs=128):
    G = K // gs
    return dict(w=torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02,
                qw=torch.randint(0, 256, (N, G, gs // 2), dtype=torch.uint8, device="cuda"),
                sc=(torch.rand(N, G, device="cuda") * 0.01).to(torch.bfloat16),
                zr=torch.randint(0, 256, (N, (G + 1) // 2), dtype=torch.uint8, device="cuda"))


def ncu_case(spec: str) -> None:
    """A few launches of one case, for `ncu`: SHAPE:default | SHAPE:bf16 | SHAPE:JSON-config."""
    from llmaccel.kernels import quant_linear as ql
    shape, _, what = spec.partition(":")
    K, N = shape_list(shape)[0]
    W = weights(K, N)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    cfg = None if what in ("", "default", "bf16") else json.loads(what)
    for _ in range(4):
        if what == "bf16":
            F.linear(x, W["w"])
        else:
            ql.linear_int4_triton(x, W["qw"], W["sc"], W["zr"], group_size=128, config=cfg)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2048x8192,8192x2048,2048x128256")
    ap.add_argument("--ncu", default=None)
    a = ap.parse_args()
    if a.ncu:
        return ncu_case(a.ncu)
    from llmaccel.kernels import quant_linear as ql
    from llmaccel.ops import quant as ref

    t0 = time.time()
    torch.manual_seed(0)
    shapes = shape_list(a.shapes)
    rows = []
    for K, N in shapes:
        W = weights(K, N)
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        b4 = nbytes(W["qw"], W["sc"], W["zr"], x) + N * 2
        b16 = nbytes(W["w"], x) + N * 2

        def copies(nb, keys):
            r = max(1, min(256, -(-ROTATE_BYTES // nb)))
            return [W] + [{k: W[k].clone() for k in keys} for _ in range(r - 1)]

        c16, c4 = copies(b16, ["w"]), copies(b4, ["qw", "sc", "zr"])
        t16 = time_graph(lambda j: (lambda: F.linear(x, c16[j]["w"])), len(c16))
        # copy of the same bytes (read + write), rotated like the weights
        src = [torch.empty(b4, dtype=torch.uint8, device="cuda") for _ in range(len(c4))]
        dst = torch.empty(b4, dtype=torch.uint8, device="cuda")
        t_copy = time_graph(lambda j: (lambda: dst.copy_(src[j])), len(src))
        del src
        # read floor: the packed words only, GEMV tiling
        KW = K // 8
        words = [ql.packed_words(c["qw"]) for c in c4]
        reads = []
        for rc in read_configs(N, KW):
            rc = dict(rc)
            split = rc.pop("SPLIT")
            o = torch.empty(split * N, dtype=torch.int32, device="cuda")
            grid = (N // rc["BLOCK_N"], split)
            try:
                t = time_graph(lambda j: (lambda: _read_kernel[grid](words[j], o, N, KW, KW // split, **rc)),
                               len(words))
            except Exception as ex:  # noqa: BLE001  (a tiling that does not fit: skip)
                print("read config failed", rc, type(ex).__name__, str(ex)[:120])
                continue
            reads.append(dict(config=dict(rc, SPLIT=split), us=t * 1e6))
        reads.sort(key=lambda r: r["us"])
        exp = ref.linear_int4(x.float(), W["qw"], W["sc"].float(), W["zr"], group_size=128)

        t_def = time_graph(lambda j: (lambda: ql.linear_int4_triton(
            x, c4[j]["qw"], c4[j]["sc"], c4[j]["zr"], group_size=128)), len(c4))
        err_def = rel_err(ql.linear_int4_triton(x, W["qw"], W["sc"], W["zr"], group_size=128), exp)
        rows.append(dict(shape=f"{K}x{N}", K=K, N=N, bytes_int4=b4, bytes_bf16=b16, bf16_us=t16 * 1e6,
                         copy_us=t_copy * 1e6, read_best=reads[:3], int4_default_us=t_def * 1e6,
                         int4_default_config=ql.int4_config(1, N, K, 128, ql._n_sm(x.device), asm=True),
                         err_default=err_def))
        del c16, c4, words
        torch.cuda.empty_cache()
        print(f"{K}x{N}: done at {time.time() - t0:.0f} s", flush=True)

    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "int4_probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows,
                       "seconds": time.time() - t0}, f, indent=1)
    for r in rows:
        if r["read_best"]:
            print(f"read {r['shape']}: {json.dumps(r['read_best'][0]['config'])}")
    print(f"\n{torch.cuda.get_device_name()}, batch 1, CUDA-graph timings, weights cold in L2; "
          f"% = of {COPY_BW / 1e12:.2f} TB/s on the int4 bytes; x = over bf16 F.linear")
    print(f"{'K x N':>12} | {'bf16':>6} | {'copy':>6} {'%':>3} | {'read':>6} {'%':>3} {'x':>5} | "
          f"{'int4':>6} {'%':>3} {'x':>5} | err")
    for r in rows:
        def pct(us):
            return 100 * r["bytes_int4"] / (us * 1e-6) / COPY_BW
        rd = r["read_best"][0]["us"] if r["read_best"] else float("nan")
        print(f"{r['shape']:>12} | {r['bf16_us']:6.2f} | {r['copy_us']:6.2f} {2 * pct(r['copy_us']):3.0f} | "
              f"{rd:6.2f} {pct(rd):3.0f} {r['bf16_us'] / rd:5.2f} | {r['int4_default_us']:6.2f} "
              f"{pct(r['int4_default_us']):3.0f} {r['bf16_us'] / r['int4_default_us']:5.2f} | "
              f"{r['err_default']:.1e}")


if __name__ == "__main__":
    main()
