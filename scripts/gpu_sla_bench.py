"""GPU bench: SLA prefill kernel (llmaccel::linear_attention, Triton) against causal SDPA.

One attention layer, batch --batch, shapes of SmolLM2-135M (9 heads, 3 KV heads, head_dim 64)
and Llama-3.2-1B (32 / 8 / 64), T = 512 .. 8192, --dtype (bf16 default). SDPA gets its preferred
(B, H, T, D) layout with the KV heads already expanded (not timed); the kernel reads the IR's
(B, T, H*D) layout. Also timed: the PyTorch reference of the same op (chunked form) and, for
decode, one token through the recurrent state (reference) next to one query of SDPA over a
cache of T tokens. The kernel is timed at a few (chunk, block_dv) settings; the best is shown.

    python scripts/gpu_sla_bench.py [--lengths 512 1024 2048 4096 8192] [--batch 1]
Prints a table last; writes $OUT/sla_bench.json if OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-1b": (32, 8, 64)}
CONFIGS = [(64, 32), (64, 64), (32, 32), (64, 16), (128, 32)]  # (chunk, block_dv)


def bench(fn, reps: int = 50) -> float:
    """Median microseconds per call (CUDA events, after warm-up)."""
    from llmaccel.bench.run import cuda_time_us

    return cuda_time_us(fn, reps=reps, warmup=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    from llmaccel.kernels.sla import linear_attention_triton
    from llmaccel.ops.sla import sla_forward

    dt = getattr(torch, a.dtype)
    rows = []
    for name, (H, Hkv, D) in SHAPES.items():
        kw = dict(n_heads=H, n_kv_heads=Hkv, head_dim=D, kernel_size=4, eps=1e-6)
        for T in a.lengths:
            B = a.batch
            q = torch.randn(B, T, H * D, device="cuda", dtype=dt)
            k = torch.randn(B, T, Hkv * D, device="cuda", dtype=dt)
            v = torch.randn(B, T, Hkv * D, device="cuda", dtype=dt)
            w = (0.1 * torch.randn(H * D, 4, device="cuda")).to(dt)
            qh = q.view(B, T, H, D).transpose(1, 2).contiguous()
            kh = k.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1).contiguous()
            vh = v.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1).contiguous()
            sdpa = bench(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True))
            ref = sla_forward(q.float(), k.float(), v.float(), w.float(), **kw)[0]
            best = None
            for chunk, bdv in CONFIGS:
                t = bench(lambda: linear_attention_triton(q, k, v, w, chunk=chunk, block_dv=bdv, **kw))
                if best is None or t < best[0]:
                    best = (t, chunk, bdv)
            t_k, chunk, bdv = best
            out = linear_attention_triton(q, k, v, w, chunk=chunk, block_dv=bdv, **kw)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            t_ref = bench(lambda: sla_forward(q, k, v, w, **kw), reps=10)
            # decode: one token through the recurrent state vs one query over T cached keys
            state = sla_forward(q, k, v, w, **kw)[1]
            q1, k1, v1 = q[:, -1:], k[:, -1:], v[:, -1:]
            dec_sla = bench(lambda: sla_forward(q1, k1, v1, w, state=state, **kw))
            dec_sdpa = bench(lambda: F.scaled_dot_product_attention(qh[:, :, -1:], kh, vh))
            rows.append({"model": name, "B": B, "T": T, "sdpa_us": round(sdpa, 1),
                         "kernel_us": round(t_k, 1), "chunk": chunk, "block_dv": bdv,
                         "speedup_vs_sdpa": round(sdpa / t_k, 3), "torch_ref_us": round(t_ref, 1),
                         "rel_err": err, "decode_sla_ref_us": round(dec_sla, 1),
                         "decode_sdpa_us": round(dec_sdpa, 1)})
            print(json.dumps(rows[-1]), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "sla_bench.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": a.dtype, "rows": rows}, f, indent=1)
    print(f"device {torch.cuda.get_device_name()}, {a.dtype}, batch {a.batch}")
    print(f"{'model':<13} {'T':>5} {'sdpa us':>9} {'sla us':>9} {'cfg':>7} {'x sdpa':>7} "
          f"{'torch us':>9} {'rel err':>8} {'dec sla':>8} {'dec sdpa':>8}")
    for r in rows:
        print(f"{r['model']:<13} {r['T']:>5} {r['sdpa_us']:>9.1f} {r['kernel_us']:>9.1f} "
              f"{r['chunk']:>3}/{r['block_dv']:<3} {r['speedup_vs_sdpa']:>7.2f} {r['torch_ref_us']:>9.1f} "
              f"{r['rel_err']:>8.1e} {r['decode_sla_ref_us']:>8.1f} {r['decode_sdpa_us']:>8.1f}")


if __name__ == "__main__":
    main()
