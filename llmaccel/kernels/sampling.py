"""Sampling without a sort: temperature, top-k and top-p per row.

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

One program walking a whole row is latency-bound: at one row of 128k logits on an H200, pass 1
took 13 us and a top-p draw 83 us, 7% of a Llama-1B decode step. Above 4096 logits the row is
cut into chunks of CHUNK, one program each, and the same algorithm runs as: _chunk_stats (per
chunk: argmax, m_c, Z_c); per round drawn by chunks (CHUNK_ROUNDS), _chunk_draw (the last
round's acceptance test; the round's target located among the chunks' masses, then inverted
inside that one chunk) and _chunk_above (per chunk: the mass above e_j, which is also the
chunk's mass of the next round's support); then _sample_kernel resuming: the last round's
test, and the rounds left of rows still rejected, or the whole algorithm for rows with top-k,
one program a row as before (H200: a top-p draw ~11 us at one row). Greedy steps take the
argmax in two launches.
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


# Logits per program and warps of the chunk kernels (vocabularies above 4096), and the rejection
# rounds they draw before the row kernel takes the rows still rejected: from CHUNK_ROUNDS_FROM
# rows, three (about (1 - top_p)^3 of the rows left: one in 8,000 at top_p 0.95; after one
# round, a 64-row step nearly always held a rejected row and waited ~60 us for one program
# walking it); below, one (each round is two more launches, ~12 us at one row on an H200).
# A row's token then depends on its batch's size through the summation order of its CDF
# only, as it already does through the logits (GEMV at one row, GEMM at more).
CHUNK, CHUNK_WARPS, CHUNK_ROUNDS, CHUNK_ROUNDS_FROM = 2048, 4, 3, 8


def config(V: int) -> tuple[int, int]:
    """(BLOCK, num_warps): one program walks a whole row, so each pass over it is V / BLOCK
    dependent loads; wide blocks keep a batch-1 step's passes short. H200, 128k bf16 logits,
    1 row, argmax / top-p 0.95 draw: 2048 x 8 warps 49 / 170 us (profiled in the engine);
    16384 x 16 warps 20 / 63 us, the best of seven shapes at 1, 64 and 256 rows
    (docs/results/h200-2026-12-01-sampler.json)."""
    if V <= 4096:
        return triton.next_power_of_2(V), 4
    return min(16384, triton.next_power_of_2(V)), 16


# Kernels taking the batch size (or a round) do not specialize on it: Triton compiles a variant
# for an int argument equal to 1 or divisible by 16, and a server meeting a new one mid-load
# compiled for seconds inside a step (H200, 256 streams: 0.78x -> 0.23x of offline throughput).
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
    def _argmax_and_mass(base, V, ts, best_i, m, z, BLOCK: tl.constexpr, GREEDY: tl.constexpr):
        """Pass 1 over a row of logits: (argmax, max and (online) sum of exp of the tempered
        logits; m and z as given when GREEDY)."""
        ar = tl.arange(0, BLOCK)
        best = tl.full([], -float("inf"), tl.float32)
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
        return best_i, m, z

    @triton.jit
    def _kth_key(base, V, ts, m, need, BLOCK: tl.constexpr):
        """The bits of the k-th largest e = exp(x / t - m) (k = need): a radix select, 8 bits a
        pass from the top, a histogram of the next byte among the keys that share the bytes found
        so far."""
        ar = tl.arange(0, BLOCK)
        prefix = tl.full([], 0, tl.int32)
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
        return prefix

    @triton.jit
    def _mass_above(base, V, ts, m, thr, low, BLOCK: tl.constexpr):
        """The sum of e over the row's tokens that top-k keeps (bits >= thr) with e > low."""
        ar = tl.arange(0, BLOCK)
        acc = tl.full([], 0.0, tl.float32)
        for off in range(0, V, BLOCK):
            cols = off + ar
            msk = cols < V
            x = tl.load(base + cols, mask=msk, other=0.0).to(tl.float32) / ts
            e = tl.exp(x - m)
            acc += tl.sum(tl.where(msk & (e.to(tl.int32, bitcast=True) >= thr) & (e > low), e, 0.0), 0)
        return acc

    @triton.jit
    def _draw(base, V, ts, m, thr, low, target, BLOCK: tl.constexpr):
        """One rejection round's token: the first whose running sum of e (over tokens kept by
        top-k with e > low) reaches target, else the last that can be drawn; (it, its e)."""
        ar = tl.arange(0, BLOCK)
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
            ll = tl.max(tl.where(sup & (w > 0), cols, -1), 0)  # a token that can be drawn
            last_e = tl.where(ll >= 0, tl.sum(tl.where(cols == ll, w, 0.0), 0), last_e)
            last = tl.maximum(last, ll)
            c += tl.sum(w, 0)
            off += BLOCK
        return tl.where(j < 0, last, j), tl.where(j < 0, last_e, ej)

    @triton.jit(do_not_specialize=["R", "B", "S", "R0"])
    def _sample_kernel(x_ptr, t_ptr, k_ptr, p_ptr, seed_ptr, pos_ptr, out_ptr, V, sx, R,
                       irow, frow, part, B, S, R0,
                       BLOCK: tl.constexpr, GREEDY: tl.constexpr, RESUME: tl.constexpr,
                       BLOCK_S: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * sx
        t = tl.load(t_ptr + row)
        ts = tl.where(t > 0, t, 1.0)
        # RESUME (after the chunk kernels): irow holds per row its state (0: the argmax is the
        # token; 1: round 0 drawn, j and e_j in irow / frow, the masses above e_j per chunk in
        # part; 2: a top-k row, the whole algorithm here), the argmax and j; frow m, Z and e_j
        st = 2
        if RESUME:
            st = tl.load(irow + row)
        best_i = tl.full([], 0, tl.int32)
        m = tl.full([], -float("inf"), tl.float32)
        z = tl.full([], 0.0, tl.float32)
        if st == 2:
            best_i, m, z = _argmax_and_mass(base, V, ts, best_i, m, z, BLOCK, GREEDY)
        else:  # the casts here and below: without RESUME irow / frow are placeholders of another
            # dtype, and Triton types both branches of a test of st (it does not fold st == 2)
            best_i = tl.load(irow + B + row).to(tl.int32)
            m = tl.load(frow + row).to(tl.float32)
            z = tl.load(frow + B + row).to(tl.float32)
        tok = best_i
        if (not GREEDY) and ((t > 0) & (st != 0)):
            k = tl.load(k_ptr + row)
            top_p = tl.load(p_ptr + row)
            thr = tl.full([], 0, tl.int32)  # the bits of the smallest e that top-k keeps
            zk = z
            if (k > 0) & (k < V):
                thr = _kth_key(base, V, ts, m, k.to(tl.int32), BLOCK)
                zk = _mass_above(base, V, ts, m, thr, -1.0, BLOCK)
            h0 = _row_hash(seed_ptr, pos_ptr, row)
            low = tl.full([], -1.0, tl.float32)
            mass = zk
            r = tl.full([], 0, tl.int32)
            done = tl.full([], 0, tl.int32)
            if st == 1:  # rounds 0 .. R0 - 1 were drawn by the chunk kernels: the last one's test
                s_off = tl.arange(0, BLOCK_S)
                above = tl.sum(tl.load(part + row * S + s_off, mask=s_off < S, other=0.0).to(tl.float32), 0)
                ok = (top_p >= 1.0) | (above < top_p * zk)
                tok = tl.where(ok, tl.load(irow + 2 * B + row).to(tl.int32), tok)
                done = ok.to(tl.int32)
                low = tl.load(frow + 2 * B + row).to(tl.float32)
                mass = above
                r = tl.full([], 0, tl.int32) + R0
            while (r < R) & (done == 0):
                j, ej = _draw(base, V, ts, m, thr, low, _uniform(h0, r) * mass, BLOCK)
                above = tl.full([], 0.0, tl.float32)
                if top_p < 1.0:
                    above = _mass_above(base, V, ts, m, thr, ej, BLOCK)
                ok = (top_p >= 1.0) | (above < top_p * zk)
                tok = tl.where(ok, j, tok)
                done = ok.to(tl.int32)
                low = ej
                mass = above
                r += 1
        tl.store(out_ptr + row, tok.to(tl.int64))

    @triton.jit
    def _row_hash(seed_ptr, pos_ptr, row):  # llmaccel.sampling._row_hash
        seed = tl.load(seed_ptr + row)
        h0 = _mix32(seed & 0xFFFFFFFF)
        h0 = _mix32(h0 ^ ((seed >> 32) & 0xFFFFFFFF))
        return _mix32(h0 ^ (tl.load(pos_ptr + row) & 0xFFFFFFFF))

    @triton.jit(do_not_specialize=["B", "S"])
    def _chunk_stats(x_ptr, t_ptr, V, sx, fch, ich, B, S, CH: tl.constexpr, GREEDY: tl.constexpr):
        """Per (row, chunk): the chunk's max logit and its first index; with sampling, the max
        m_c of the tempered logits and Z_c = sum exp(x - m_c)."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        cols = c * CH + tl.arange(0, CH)
        msk = cols < V
        lg = tl.load(x_ptr + row.to(tl.int64) * sx + cols, mask=msk, other=-float("inf")).to(tl.float32)
        cmax = tl.max(lg, 0)
        at = row * S + c
        tl.store(fch + at, cmax)
        tl.store(ich + at, tl.min(tl.where(lg == cmax, cols, V), 0))
        if not GREEDY:
            t = tl.load(t_ptr + row)
            x = lg / tl.where(t > 0, t, 1.0)
            mc = tl.max(x, 0)
            safe = tl.where(mc > -float("inf"), mc, 0.0)  # a chunk of -inf logits holds no mass
            tl.store(fch + B * S + at, mc)
            tl.store(fch + 2 * B * S + at, tl.sum(tl.where(msk, tl.exp(x - safe), 0.0), 0))

    @triton.jit
    def _row_argmax(fch, ich, row, S, V, BLOCK_S: tl.constexpr):
        so = tl.arange(0, BLOCK_S)
        best = tl.load(fch + row * S + so, mask=so < S, other=-float("inf"))
        idx = tl.load(ich + row * S + so, mask=so < S, other=V)
        return tl.min(tl.where(best == tl.max(best, 0), idx, V), 0)

    @triton.jit(do_not_specialize=["S"])
    def _chunk_argmax(fch, ich, out_ptr, S, V, BLOCK_S: tl.constexpr):
        row = tl.program_id(0)
        tl.store(out_ptr + row, _row_argmax(fch, ich, row, S, V, BLOCK_S).to(tl.int64))

    @triton.jit
    def _chunk_token(xrow, c, V, t, m, low, target, before, CH: tl.constexpr):
        """In chunk c of a row's logits (at xrow): the first token whose running sum of
        e = exp(x / t - m) over e > low, after the chunks' mass `before`, reaches target, else the
        last with mass; (it, its e)."""
        cols = c * CH + tl.arange(0, CH)
        msk = cols < V
        x = tl.load(xrow + cols, mask=msk, other=0.0).to(tl.float32)
        e = tl.exp(x / t - m)
        sup = msk & (e > low)
        ws = tl.where(sup, e, 0.0)
        j = tl.min(tl.where((tl.cumsum(ws, 0) + before >= target) & sup, cols, V), 0)
        last = tl.max(tl.where(ws > 0, cols, -1), 0)
        # (no token with mass left in the chunk: exp flushed them to zero)
        last = tl.where(last >= 0, last, tl.max(tl.where(sup, cols, -1), 0))
        j = tl.where(j < V, j, last)
        return j, tl.sum(tl.where(cols == j, ws, 0.0), 0)

    @triton.jit(do_not_specialize=["B", "S", "r"])
    def _chunk_draw(x_ptr, t_ptr, k_ptr, p_ptr, seed_ptr, pos_ptr, V, sx, fch, part, ich, irow, frow,
                    B, S, r, CH: tl.constexpr, BLOCK_S: tl.constexpr, FIRST: tl.constexpr):
        """Round r of the rows in state 1, one program per (row, chunk). FIRST (round 0): the
        state, argmax, m and Z per row (irow / frow as _sample_kernel's RESUME reads them), the
        chunks' masses from their m_c and Z_c. Later rounds: round r - 1's acceptance test on
        the masses above e_j that _chunk_above left per chunk (accepted: state 0, the token in
        the argmax's slot), and those masses are the chunks' masses of the new support {e > e_j}.
        The chunk whose prefix of masses reaches u_r * mass inverts its part of the CDF."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        rr = tl.full([], 0, tl.int32) + r  # an int32 tensor, as _uniform takes the round
        t = tl.load(t_ptr + row)
        so = tl.arange(0, BLOCK_S)
        if FIRST:
            k = tl.load(k_ptr + row)
            st = tl.where(t > 0, tl.where((k > 0) & (k < V), 2, 1), 0)
            if c == 0:
                tl.store(irow + row, st)
                tl.store(irow + B + row, _row_argmax(fch, ich, row, S, V, BLOCK_S))
        else:
            st = tl.load(irow + row)
        if st == 1:
            if FIRST:
                mc = tl.load(fch + B * S + row * S + so, mask=so < S, other=-float("inf"))
                zc = tl.load(fch + 2 * B * S + row * S + so, mask=so < S, other=0.0)
                m = tl.max(mc, 0)
                w = zc * tl.exp(mc - m)
                mass = tl.sum(w, 0)
                low = -1.0
                go = True
                if c == 0:
                    tl.store(frow + row, m)
                    tl.store(frow + B + row, mass)
            else:
                m = tl.load(frow + row)
                top_p = tl.load(p_ptr + row)
                w = tl.load(part + row * S + so, mask=so < S, other=0.0)
                mass = tl.sum(w, 0)
                low = tl.load(frow + 2 * B + row)
                go = (top_p < 1.0) & (mass >= top_p * tl.load(frow + B + row))
                if (c == 0) & (go == 0):
                    tl.store(irow + B + row, tl.load(irow + 2 * B + row))
                    tl.store(irow + row, 0)
            if go:
                target = _uniform(_row_hash(seed_ptr, pos_ptr, row), rr) * mass
                hit = tl.min(tl.where((tl.cumsum(w, 0) >= target) & (so < S), so, S), 0)
                # rounding may leave the target unmet: the last token with mass, as the reference
                fall = tl.max(tl.where((so < S) & (w > 0), so, 0), 0)
                if c == tl.where(hit < S, hit, fall):
                    j, ej = _chunk_token(x_ptr + row.to(tl.int64) * sx, c, V, t, m, low, target,
                                         tl.sum(tl.where(so < c, w, 0.0), 0), CH)
                    tl.store(irow + 2 * B + row, j)
                    tl.store(frow + 2 * B + row, ej)

    @triton.jit(do_not_specialize=["B", "S"])
    def _chunk_above(x_ptr, t_ptr, p_ptr, V, sx, part, irow, frow, B, S, CH: tl.constexpr):
        """Per (row, chunk) of a row in state 1: the mass of the chunk's tokens above e_j."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        a = 0.0
        if (tl.load(irow + row) == 1) & (tl.load(p_ptr + row) < 1.0):
            cols = c * CH + tl.arange(0, CH)
            msk = cols < V
            x = tl.load(x_ptr + row.to(tl.int64) * sx + cols, mask=msk, other=0.0).to(tl.float32)
            e = tl.exp(x / tl.load(t_ptr + row) - tl.load(frow + row))
            a = tl.sum(tl.where(msk & (e > tl.load(frow + 2 * B + row)), e, 0.0), 0)
        tl.store(part + row * S + c, a)


def chunk_size(V: int, chunk: int | None = None) -> int:
    """Logits per program of the chunk kernels, 0 for one program per row (small vocabularies,
    where one program's passes are short). A function of V alone: a row's chunks do not depend
    on the batch it is in."""
    if chunk is None:
        return CHUNK if V > 4096 else 0
    return chunk


def _workspace(B: int, S: int, device) -> tuple[torch.Tensor, ...]:
    """Per (row, chunk) floats (best logit, m_c, Z_c), masses above e_j and argmax indices; per
    row ints (state, argmax, j) and floats (m, Z, e_j). The masses above e_j are read through
    a tensor of their own: a view at an offset of B * S floats would change its alignment,
    which Triton specializes on, with the batch size."""
    return (torch.empty((3, B, S), dtype=torch.float32, device=device),
            torch.empty((B, S), dtype=torch.float32, device=device),
            torch.empty((B, S), dtype=torch.int32, device=device),
            torch.empty((3, B), dtype=torch.int32, device=device),
            torch.empty((3, B), dtype=torch.float32, device=device))


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  rounds: int, block: int | None = None, num_warps: int | None = None,
                  chunk: int | None = None) -> torch.Tensor:
    """Tokens (B,) int64 for logits (B, V) (any float dtype, unit stride in V); temperature,
    top_p float32 (B,), top_k, seeds, positions int64 (B,); the uniforms of the rounds are
    llmaccel.sampling.round_uniforms(seeds, positions, rounds), hashed in the kernel.
    chunk: see chunk_size."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cb, cw = config(V)
    dev = logits.device
    out = torch.empty(B, dtype=torch.int64, device=dev)
    t, k = temperature.float().contiguous(), top_k.contiguous()
    p, seeds, positions = top_p.float().contiguous(), seeds.contiguous(), positions.contiguous()
    ch = chunk_size(V, chunk)
    if ch and B:
        S = triton.cdiv(V, ch)
        bs = triton.next_power_of_2(S)
        fch, part, ich, irow, frow = _workspace(B, S, dev)
        _chunk_stats[(B, S)](logits, t, V, logits.stride(0), fch, ich, B, S, CH=ch, GREEDY=False,
                             num_warps=CHUNK_WARPS)
        drawn = min(CHUNK_ROUNDS if B >= CHUNK_ROUNDS_FROM else 1, rounds)
        for r in range(drawn):
            _chunk_draw[(B, S)](logits, t, k, p, seeds, positions, V, logits.stride(0), fch, part, ich,
                                irow, frow, B, S, r, CH=ch, BLOCK_S=bs, FIRST=r == 0, num_warps=CHUNK_WARPS)
            _chunk_above[(B, S)](logits, t, p, V, logits.stride(0), part, irow, frow, B, S, CH=ch,
                                 num_warps=CHUNK_WARPS)
        _sample_kernel[(B,)](logits, t, k, p, seeds, positions, out, V, logits.stride(0), rounds,
                             irow, frow, part, B, S, drawn, BLOCK=block or cb, GREEDY=False,
                             RESUME=True, BLOCK_S=bs, num_warps=num_warps or cw)
    elif B:
        _sample_kernel[(B,)](logits, t, k, p, seeds, positions, out, V, logits.stride(0), rounds,
                             out, out, out, B, 1, 0, BLOCK=block or cb, GREEDY=False, RESUME=False,
                             BLOCK_S=2, num_warps=num_warps or cw)
    return out


def argmax_triton(logits: torch.Tensor, block: int | None = None,
                  num_warps: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """logits.argmax(-1) (the first maximal index) of (B, V), each row read once (torch's
    reduction of one 128k row takes ~37 us on an H200). chunk: see chunk_size."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cb, cw = config(V)
    dev = logits.device
    out = torch.empty(B, dtype=torch.int64, device=dev)
    ch = chunk_size(V, chunk)
    if ch and B:
        S = triton.cdiv(V, ch)
        fch, _, ich, _, _ = _workspace(B, S, dev)
        _chunk_stats[(B, S)](logits, fch, V, logits.stride(0), fch, ich, B, S, CH=ch, GREEDY=True,
                             num_warps=CHUNK_WARPS)
        _chunk_argmax[(B,)](fch, ich, out, S, V, BLOCK_S=triton.next_power_of_2(S))
    elif B:
        z = torch.zeros(B, dtype=torch.float32, device=dev)
        _sample_kernel[(B,)](logits, z, out, z, out, out, out, V, logits.stride(0), 1, out, z, z, B, 1, 0,
                             BLOCK=block or cb, GREEDY=True, RESUME=False, BLOCK_S=2,
                             num_warps=num_warps or cw)
    return out
