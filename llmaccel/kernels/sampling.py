"""Sampling without a sort: temperature, top-k and top-p per row, one program per row.

The reference is llmaccel.sampling.sample_reference; this kernel runs the same
algorithm, pass for pass, so both draw the same token from the same uniforms (up to the
summation order of the prefix sums, which can only matter when a uniform falls within a few
ulps of a token's boundary):

1. one pass: the argmax (greedy rows stop here), the max m of x = logits / temperature and
   Z = sum exp(x - m) (online);
2. rows with 0 < top_k < V: the k-th largest e = exp(x - m) by a radix select on its bit
   pattern (non-negative floats order as their int32 bits): four passes, each a histogram of
   the next byte among the keys that share the bytes found so far (the reference bisects the
   same value); Zk = the mass of {e >= that value} (Z without top-k);
3. rejection rounds (FlashInfer's sorting-free top-p): draw j by inverting the CDF of the
   support in vocabulary order (the pass stops at the crossing); accept when the mass of the
   tokens above e_j is below top_p * Zk (j is in the nucleus), else the support becomes
   {e > e_j} and the next round draws again. A draw from the whole support lands in the
   nucleus with probability >= top_p, so about 1 / top_p rounds; an accepted draw follows the
   nucleus distribution exactly. Rows still rejected after the last uniform take the argmax
   (which is always in the nucleus).

A sort of a (64, 128k) logits block costs ~1.4 ms on an H200; these passes read each row from
L2 two or three times (top-k adds five). The uniforms are hashed in the kernel
(round_uniforms' hash, in int64 arithmetic) so a sampled step launches nothing before it.
"""
from __future__ import annotations

import torch

try:  # kernels are optional: every non-CUDA path works without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is absent
    triton = None
    tl = None

HAS_TRITON = triton is not None


def config(V: int) -> tuple[int, int]:
    """(BLOCK, num_warps): one program walks a whole row, so each pass over it is V / BLOCK
    dependent loads; wide blocks keep a batch-1 step's passes short. H200, 128k bf16 logits,
    1 row, argmax / top-p 0.95 draw: 2048 x 8 warps 49 / 170 us (profiled in the engine);
    16384 x 16 warps 20 / 63 us, the best of seven shapes at 1, 64 and 256 rows
    (docs/results/h200-2026-12-01-sampler.json)."""
    if V <= 4096:
        return triton.next_power_of_2(V), 4
    return min(16384, triton.next_power_of_2(V)), 16


if HAS_TRITON:
    @triton.jit
    def _mix32(x):  # llmaccel.sampling._mix32, on int64 values in [0, 2^32)
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _uniform(h0, r):  # llmaccel.sampling.round_uniforms' round r, from the row's hash h0
        h = h0
        if r > 0:
            h = _mix32(h0 ^ ((r.to(tl.int64) * 0x9E3779B9) & 0xFFFFFFFF))
        return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)

    @triton.jit
    def _sample_kernel(x_ptr, t_ptr, k_ptr, p_ptr, seed_ptr, pos_ptr, out_ptr, V, sx, R,
                       BLOCK: tl.constexpr, GREEDY: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * sx
        t = tl.load(t_ptr + row)
        ts = tl.where(t > 0, t, 1.0)
        ar = tl.arange(0, BLOCK)
        # pass 1: argmax of the logits, max and (online) sum of exp of the tempered logits
        best = -float("inf")
        best_i = 0
        m = -float("inf")
        z = 0.0
        for off in range(0, V, BLOCK):
            cols = off + ar
            msk = cols < V
            lg = tl.load(base + cols, mask=msk, other=-float("inf")).to(tl.float32)
            cmax = tl.max(lg, 0)
            cidx = tl.min(tl.where(lg == cmax, cols, V), 0)
            best_i = tl.where(cmax > best, cidx, best_i)
            best = tl.maximum(best, cmax)
            if not GREEDY:
                x = lg / ts
                nm = tl.maximum(m, tl.max(x, 0))
                z = z * tl.exp(m - nm) + tl.sum(tl.where(msk, tl.exp(x - nm), 0.0), 0)
                m = nm
        tok = best_i
        if (not GREEDY) and (t > 0):
            k = tl.load(k_ptr + row)
            top_p = tl.load(p_ptr + row)
            thr = tl.full([], 0, tl.int32)  # the bits of the smallest e that top-k keeps
            zk = z
            if (k > 0) & (k < V):
                # radix select of the k-th largest key, 8 bits a pass from the top: a
                # histogram of the next byte among the keys that share the bytes found so far
                prefix = tl.full([], 0, tl.int32)
                need = k.to(tl.int32)
                bins = tl.arange(0, 256)
                for level in tl.static_range(4):
                    SHIFT = 24 - 8 * level
                    h = tl.zeros([256], dtype=tl.int32)
                    for off in range(0, V, BLOCK):
                        cols = off + ar
                        msk = cols < V
                        x = tl.load(base + cols, mask=msk, other=0.0).to(tl.float32) / ts
                        key = tl.exp(x - m).to(tl.int32, bitcast=True)
                        if level > 0:
                            msk = msk & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
                        h += tl.histogram((key >> SHIFT) & 0xFF, 256, mask=msk)
                    ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # keys in this byte's bins >= b
                    b = tl.sum((ge >= need).to(tl.int32), 0) - 1
                    need -= tl.sum(tl.where(bins > b, h, 0), 0)
                    prefix = prefix | (b << SHIFT)
                thr = prefix
                zk = 0.0
                for off in range(0, V, BLOCK):
                    cols = off + ar
                    msk = cols < V
                    x = tl.load(base + cols, mask=msk, other=0.0).to(tl.float32) / ts
                    e = tl.exp(x - m)
                    zk += tl.sum(tl.where(msk & (e.to(tl.int32, bitcast=True) >= thr), e, 0.0), 0)
            seed = tl.load(seed_ptr + row)
            h0 = _mix32(seed & 0xFFFFFFFF)
            h0 = _mix32(h0 ^ ((seed >> 32) & 0xFFFFFFFF))
            h0 = _mix32(h0 ^ (tl.load(pos_ptr + row) & 0xFFFFFFFF))
            low = tl.full([], -1.0, tl.float32)
            mass = zk
            r = tl.full([], 0, tl.int32)
            done = tl.full([], 0, tl.int32)
            while (r < R) & (done == 0):
                target = _uniform(h0, r) * mass
                c = tl.full([], 0.0, tl.float32)
                j = tl.full([], -1, tl.int32)
                ej = tl.full([], 0.0, tl.float32)
                last = tl.full([], -1, tl.int32)
                last_e = tl.full([], 0.0, tl.float32)
                off = tl.full([], 0, tl.int32)
                while (off < V) & (j < 0):
                    cols = off + ar
                    msk = cols < V
                    x = tl.load(base + cols, mask=msk, other=0.0).to(tl.float32) / ts
                    e = tl.exp(x - m)
                    sup = msk & (e.to(tl.int32, bitcast=True) >= thr) & (e > low)
                    w = tl.where(sup, e, 0.0)
                    cs = tl.cumsum(w, 0) + c
                    jj = tl.min(tl.where((cs >= target) & sup, cols, V), 0)
                    ej = tl.sum(tl.where(cols == jj, w, 0.0), 0)
                    j = tl.where(jj < V, jj, -1)
                    ll = tl.max(tl.where(sup, cols, -1), 0)
                    last_e = tl.where(ll >= 0, tl.sum(tl.where(cols == ll, w, 0.0), 0), last_e)
                    last = tl.maximum(last, ll)
                    c += tl.sum(w, 0)
                    off += BLOCK
                ej = tl.where(j < 0, last_e, ej)
                j = tl.where(j < 0, last, j)
                above = tl.full([], 0.0, tl.float32)
                if top_p < 1.0:
                    for off2 in range(0, V, BLOCK):
                        cols = off2 + ar
                        msk = cols < V
                        x = tl.load(base + cols, mask=msk, other=0.0).to(tl.float32) / ts
                        e = tl.exp(x - m)
                        keep = msk & (e.to(tl.int32, bitcast=True) >= thr) & (e > ej)
                        above += tl.sum(tl.where(keep, e, 0.0), 0)
                ok = (top_p >= 1.0) | (above < top_p * zk)
                tok = tl.where(ok, j, tok)
                done = ok.to(tl.int32)
                low = ej
                mass = above
                r += 1
        tl.store(out_ptr + row, tok.to(tl.int64))


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  rounds: int, block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Tokens (B,) int64 for logits (B, V) (any float dtype, unit stride in V); temperature,
    top_p float32 (B,), top_k, seeds, positions int64 (B,); the uniforms of the rounds are
    llmaccel.sampling.round_uniforms(seeds, positions, rounds), hashed in the kernel."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cb, cw = config(V)
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    _sample_kernel[(B,)](logits, temperature.float().contiguous(), top_k.contiguous(),
                         top_p.float().contiguous(), seeds.contiguous(), positions.contiguous(), out,
                         V, logits.stride(0), rounds, BLOCK=block or cb, GREEDY=False,
                         num_warps=num_warps or cw)
    return out


def argmax_triton(logits: torch.Tensor, block: int | None = None,
                  num_warps: int | None = None) -> torch.Tensor:
    """logits.argmax(-1) (the first maximal index) of (B, V): one program per row reads it once
    (torch's reduction of one 128k row takes ~37 us on an H200)."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cb, cw = config(V)
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    z = torch.zeros(B, dtype=torch.float32, device=logits.device)
    _sample_kernel[(B,)](logits, z, out, z, out, out, out, V, logits.stride(0), 1,
                         BLOCK=block or cb, GREEDY=True, num_warps=num_warps or cw)
    return out
