"""sla with a window: exact softmax attention over the last `window` tokens (and the first `sinks`
tokens), SLAB's linear attention over the tokens in between, one normalizer for both (LoLCATs'
sliding-window hybrid). For query t at position p, with scores s_ps = scale q_p . k_s:

    exact(p) = {s <= p : p - s < window or s < sinks},   mid(p) = {s <= p} - exact(p)
    num = sum_{exact} exp(s_ps - m_p) v_s + exp(mix_h - m_p) phi(q_p) . sum_{mid} phi(k_s)^T v_s
    den = sum_{exact} exp(s_ps - m_p)     + exp(mix_h - m_p) phi(q_p) . sum_{mid} phi(k_s)
    out = num / den (+ the depthwise conv on the values, as without a window)

phi = ReLU, m_p the largest exact score (the exact set always holds the token itself), mix_h a
learned log-scale per query head that puts the linear part's mass on the softmax's scale. A
window as long as the sequence is softmax attention. The recurrent state holds S = sum
phi(k)^T v and z = sum phi(k) over the tokens that left the window, the kept keys and values
(the sinks and the last window - 1 tokens) with their positions, and the count of tokens seen:
its size is constant in the length. A step of T tokens from a state costs O(T (T + window +
sinks)) (window_forward); the whole-sequence form runs in window-sized chunks (window_whole).
"""
from __future__ import annotations

import torch


def window_state_bytes(n_kv_heads: int, head_dim: int, window: int, sinks: int,
                       dtype_bytes: int = 2) -> int:
    """The kept keys and values of one layer for one sequence (beside S, z and the conv tail)."""
    return (sinks + max(window - 1, 0)) * 2 * n_kv_heads * head_dim * dtype_bytes


def split_keys(qpos: torch.Tensor, kpos: torch.Tensor, window: int, sinks: int):
    """(exact, mid) masks (Tq, Tk) of the keys at positions kpos for queries at positions qpos."""
    back = qpos[:, None] - kpos[None, :]
    causal = back >= 0
    exact = causal & ((back < window) | (kpos[None, :] < sinks))
    return exact, causal & ~exact


def _attend(q, k, v, kk, vv, mix, exact, mid, Hkv: int, D: int, scale: float, eps: float, S, z):
    """The windowed attention of q over the kept keys and values then k, v (one normalizer for the
    exact and the linear part); exact and mid are key masks broadcastable to (B, Hkv, G, T, L + T).
    Returns (out (B, T, H*D) fp32, phi of the keys and the values (B, Hkv, L + T, D), fp32)."""
    B, T, HD = q.shape
    G = HD // (Hkv * D)
    keys = torch.cat([kk.to(k.dtype), k], 1).float().view(B, -1, Hkv, D).transpose(1, 2)
    vals = torch.cat([vv.to(v.dtype), v], 1).float().view(B, -1, Hkv, D).transpose(1, 2)
    qh = q.float().view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)         # (B, Hkv, G, T, D)
    sc = (qh @ keys[:, :, None].transpose(-1, -2)) * scale             # (B, Hkv, G, T, L + T)
    sc = sc.masked_fill(~exact, float("-inf"))
    m = sc.amax(-1, keepdim=True)
    e = torch.exp(sc - m)
    fq, fk = torch.relu(qh), torch.relu(keys)
    lin = (fq @ fk[:, :, None].transpose(-1, -2)).masked_fill(~mid, 0.0)
    f = torch.exp(mix.float().view(Hkv, G, 1, 1) - m)                  # (B, Hkv, G, T, 1)
    num = e @ vals[:, :, None] + f * (lin @ vals[:, :, None] + fq @ S[:, :, None])
    den = e.sum(-1, keepdim=True) + f * (lin.sum(-1, keepdim=True) + fq @ z[:, :, None, :, None])
    return (num / (den + eps)).permute(0, 3, 1, 2, 4).reshape(B, T, HD), fk, vals


def window_forward(q, k, v, mix, *, n_heads: int, n_kv_heads: int, head_dim: int, window: int,
                   sinks: int, scale: float, eps: float, S, z, kept):
    """The attention part (no conv) of the windowed op from state (S, z, kept), and the state
    after these tokens.

    q (B, T, H*D), k and v (B, T, Hkv*D), mix (H,); S (B, Hkv, D, D) and z (B, Hkv, D) fp32;
    kept = (keys (B, L, Hkv*D), values (B, L, Hkv*D), positions (L,) int64, seen () int64).
    Returns (out (B, T, H*D) fp32, S, z, kept) after these T tokens.
    """
    B, T, _ = q.shape
    kk, vv, kpos, seen = kept
    pos = seen + torch.arange(T, device=q.device)                      # (T,) absolute positions
    apos = torch.cat([kpos, pos])                                      # (L + T,)
    exact, mid = split_keys(pos, apos, window, sinks)
    out, fk, vals = _attend(q, k, v, kk, vv, mix, exact, mid, n_kv_heads, head_dim, scale, eps, S, z)
    # tokens that no later query sees exactly move into the state; the rest stay kept
    end = seen + T
    fold = (apos >= sinks) & (apos <= end - window)
    keep = ~fold
    fk_f, v_f = fk[:, :, fold], vals[:, :, fold]
    S = S + fk_f.transpose(-1, -2) @ v_f
    z = z + fk_f.sum(-2)
    allk, allv = torch.cat([kk, k.to(kk.dtype)], 1), torch.cat([vv, v.to(vv.dtype)], 1)
    kept = (allk[:, keep], allv[:, keep], apos[keep], end)
    return out, S, z, kept


def ring_size(window: int, sinks: int) -> int:
    """Slots of the ring form of the kept tokens: the sinks, then the last window - 1 tokens."""
    return sinks + max(window - 1, 0)


def ring_index(pos: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """The slot of a kept token at `pos` in the ring form: a sink at its own position, any other
    token at sinks + (pos - sinks) mod (window - 1), so that a new token takes the slot of the
    one that leaves the window as it arrives (the one window - 1 tokens before it)."""
    if window <= 1:   # no token but the sinks is ever kept
        return pos
    return torch.where(pos < sinks, pos, sinks + (pos - sinks).remainder(window - 1))


def to_ring(kept, window: int, sinks: int):
    """Kept tokens as window_forward leaves them (keys, values (B, L, C), positions (L,), seen ())
    -> the ring form: keys, values (B, ring_size, C), positions (B, ring_size) (-1: empty slot),
    seen (B,)."""
    kk, vv, kpos, seen = kept
    B, _, C = kk.shape
    n = ring_size(window, sinks)
    idx = ring_index(kpos, window, sinks)
    rk = kk.new_zeros(B, n, C).index_copy(1, idx, kk)
    rv = vv.new_zeros(B, n, C).index_copy(1, idx, vv)
    rp = kpos.new_full((B, n), -1).index_copy(1, idx, kpos.expand(B, -1))
    return rk, rv, rp, seen.expand(B).clone()


def from_ring(ring):
    """The ring form of one sequence -> window_forward's kept tokens, in the order of positions."""
    rk, rv, rp, seen = ring
    pos, order = rp[0].sort()
    order = order[pos >= 0]
    return rk[:, order], rv[:, order], rp[0, order], seen[0]


def ring_decode(q, k, v, mix, *, n_heads: int, n_kv_heads: int, head_dim: int, window: int,
                sinks: int, scale: float, eps: float, S, z, ring):
    """window_forward for one new token of each of B sequences at once, each at its own position,
    from their states in the ring form (to_ring; stacked along B). Every kept token is exact for
    the new one (the sinks and the last window - 1 tokens), so the only linear part is S and z;
    the token leaving the window (in the slot the new one takes) then moves into S and z. Shapes
    do not depend on the positions, and nothing is read back to the host. q (B, 1, H*D), k and v
    (B, 1, Hkv*D). Returns (out (B, 1, H*D) fp32, S, z, ring). Equal to window_forward row by row
    (tested)."""
    B, Hkv, D = q.shape[0], n_kv_heads, head_dim
    rk, rv, rp, seen = ring
    n = rk.shape[1]
    G = q.shape[-1] // (Hkv * D)
    # _attend for one query per row, written with the group as the matmuls' rows (batch dims B
    # and Hkv): no broadcast copies, a third of the ops (the decode step is launch-bound on a GPU)
    valid = torch.cat([rp >= 0, torch.ones_like(rp[:, :1], dtype=torch.bool)], 1)   # (B, L + 1)
    keys = torch.cat([rk.to(k.dtype), k], 1).float().view(B, n + 1, Hkv, D).transpose(1, 2)
    vals = torch.cat([rv.to(v.dtype), v], 1).float().view(B, n + 1, Hkv, D).transpose(1, 2)
    qh = q.float().view(B, Hkv, G, D)
    sc = (qh @ keys.transpose(-1, -2)).mul_(scale).masked_fill_(~valid[:, None, None, :], float("-inf"))
    m = sc.amax(-1, keepdim=True)                                                  # (B, Hkv, G, 1)
    e = torch.exp(sc - m)
    fq, fk = torch.relu(qh), torch.relu(keys)
    f = torch.exp(mix.float().view(Hkv, G, 1) - m)
    num = e @ vals + f * (fq @ S)
    den = e.sum(-1, keepdim=True) + f * (fq @ z[..., None])
    out = (num / (den + eps)).reshape(B, 1, -1)
    if window > 1:   # the new token takes the slot of the one leaving the window, which folds
        slot = ring_index(seen, window, sinks)                                     # (B,)
        fold = rp.gather(1, slot[:, None]) >= 0                                     # (B, 1)
        at = slot[:, None, None, None].expand(B, Hkv, 1, D)
        fk_f, v_f = fk.gather(2, at), vals.gather(2, at)
        stay = None
    else:            # window 1: the new token itself folds unless it is a sink
        slot = seen.clamp(max=max(n - 1, 0))
        fold = (seen >= sinks)[:, None]
        fk_f, v_f = fk[:, :, -1:], vals[:, :, -1:]
        stay = seen < sinks
    fk_f = fk_f * fold[:, :, None, None]
    S = S + fk_f.transpose(-1, -2) @ v_f
    z = z + fk_f.sum(-2)
    if n:
        C = rk.shape[-1]
        at, sp = slot[:, None, None].expand(B, 1, C), slot[:, None]
        nk, nv, npos = k.to(rk.dtype), v.to(rv.dtype), seen[:, None]
        if stay is not None:   # window 1: only a sink is written
            keep = stay[:, None]
            nk = torch.where(keep[..., None], nk, rk.gather(1, at))
            nv = torch.where(keep[..., None], nv, rv.gather(1, at))
            npos = torch.where(keep, npos, rp.gather(1, sp))
        rk, rv, rp = rk.scatter(1, at, nk), rv.scatter(1, at, nv), rp.scatter(1, sp, npos)
    return out, S, z, (rk, rv, rp, seen + 1)


def window_whole(q, k, v, mix, *, n_heads: int, n_kv_heads: int, head_dim: int, window: int,
                 sinks: int, scale: float, eps: float) -> torch.Tensor:
    """The attention part of the whole-sequence form (empty state, no state out) in chunks of
    `window` tokens: memory O(T (2 window + sinks)), not O(T^2), and no loop over chunks (the
    heal traces it). For a query at offset a of chunk i: its own chunk's keys up to a and the
    previous chunk's keys after offset a are the window (exact); the previous chunk's keys up to
    offset a and every chunk before it are linear (their phi(k)^T v summed over chunks, like
    _la_chunks' state); the sinks are exact keys of their own, counted once where the window
    does not already hold them. Equal to window_forward from the empty state (tested)."""
    B, T, _ = q.shape
    Hkv, D, c = n_kv_heads, head_dim, window
    G = n_heads // Hkv
    N = -(-T // c)
    pad = N * c - T
    qh = q.float().view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)                  # (B, Hkv, G, T, D)
    kh = k.float().view(B, T, Hkv, D).transpose(1, 2)
    vh = v.float().view(B, T, Hkv, D).transpose(1, 2)
    sk, sv = kh[:, :, :sinks], vh[:, :, :sinks]                                   # (B, Hkv, ns, D)
    if pad:
        qh, kh, vh = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (qh, kh, vh))
    dev = q.device
    pos = torch.arange(N * c, device=dev).view(N, c)
    qc = qh.reshape(B, Hkv, G, N, c, D)
    kc, vc = kh.reshape(B, Hkv, N, c, D)[:, :, None], vh.reshape(B, Hkv, N, c, D)[:, :, None]
    kp = torch.nn.functional.pad(kc, (0, 0, 0, 0, 1, 0))[:, :, :, :N]             # previous chunk
    vp = torch.nn.functional.pad(vc, (0, 0, 0, 0, 1, 0))[:, :, :, :N]
    ar = torch.arange(c, device=dev)
    has_prev = (torch.arange(N, device=dev) > 0)[:, None, None]                    # (N, 1, 1)
    cur_exact = (ar[None, :] <= ar[:, None])[None]                                # (1, c, c)
    prev_exact = has_prev & (ar[None, :] > ar[:, None])[None]
    prev_pos = pos - c                                                            # key positions
    prev_mid = has_prev & ~prev_exact & (prev_pos[:, None, :] >= sinks)
    s_cur = (qc @ kc.transpose(-1, -2)) * scale
    s_prev = (qc @ kp.transpose(-1, -2)) * scale
    parts = [s_cur.masked_fill(~cur_exact, float("-inf")), s_prev.masked_fill(~prev_exact, float("-inf"))]
    if sinks:   # a sink outside the window: causal, and window tokens or more behind the query
        # ns = min(sinks, T): a prompt shorter than the sinks has only its own tokens as sinks
        back = pos[:, :, None] - torch.arange(sk.shape[2], device=dev)[None, None]  # (N, c, ns)
        s_snk = (qc @ sk[:, :, None, None].transpose(-1, -2)) * scale
        parts.append(s_snk.masked_fill(~(back >= c), float("-inf")))
    m = torch.cat([x.amax(-1, keepdim=True) for x in parts], -1).amax(-1, keepdim=True)
    e = [torch.exp(x - m) for x in parts]
    num = e[0] @ vc + e[1] @ vp + (e[2] @ sv[:, :, None, None] if sinks else 0)
    den = sum(x.sum(-1, keepdim=True) for x in e)
    # linear part: phi(k) of the sinks is left out (they are exact); chunks i-2 and before by state
    fq = torch.relu(qc)
    lin_ok = (pos >= sinks)[None, None, None, :, :, None]
    fk = torch.relu(kc) * lin_ok
    fkp = torch.nn.functional.pad(fk, (0, 0, 0, 0, 1, 0))[:, :, :, :N]
    a = (fq @ fkp.transpose(-1, -2)).masked_fill(~prev_mid, 0.0)
    dS = fk.transpose(-1, -2) @ vc                                                # (B, Hkv, 1, N, D, D)
    dz = fk.sum(-2)                                                               # (B, Hkv, 1, N, D)
    S2 = torch.nn.functional.pad(dS.cumsum(3), (0, 0, 0, 0, 2, 0))[:, :, :, :N]    # chunks <= i - 2
    z2 = torch.nn.functional.pad(dz.cumsum(3), (0, 0, 2, 0))[:, :, :, :N]
    f = torch.exp(mix.float().view(Hkv, G, 1, 1, 1) - m)
    num = num + f * (a @ vp + fq @ S2)
    den = den + f * (a.sum(-1, keepdim=True) + fq @ z2[..., None])
    out = (num / (den + eps)).reshape(B, Hkv, G, N * c, D)[..., :T, :]
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, n_heads * D)


def window_state(k, v, *, n_kv_heads: int, head_dim: int, window: int, sinks: int):
    """The state (S, z, kept) after a sequence's first T tokens, k and v (B, T, Hkv*D), as
    window_forward leaves it from the empty state: the tokens that left the window summed into S
    and z, the sinks and the last window - 1 tokens kept. With window_whole for the outputs, a
    prompt costs O(T (2 window + sinks)) instead of window_forward's O(T^2)."""
    B, T, C = k.shape
    Hkv, D = n_kv_heads, head_dim
    pos = torch.arange(T, device=k.device)
    fold = (pos >= sinks) & (pos <= T - window)
    fk = torch.relu(k[:, fold].float()).view(B, -1, Hkv, D).transpose(1, 2)
    vf = v[:, fold].float().view(B, -1, Hkv, D).transpose(1, 2)
    keep = ~fold
    kept = (k[:, keep].to(v.dtype), v[:, keep], pos[keep], torch.tensor(T, device=k.device))
    return fk.transpose(-1, -2) @ vf, fk.sum(-2), kept


def ring_state(k, v, lens: torch.Tensor, *, n_kv_heads: int, head_dim: int, window: int, sinks: int):
    """window_state then to_ring for B prompts at once, right-padded to one length: row i's
    (S, z, ring form) after its first lens[i] tokens of k, v (B, L, Hkv*D). Equal to window_state
    and to_ring row by row (tested)."""
    B, L, C = k.shape
    Hkv, D = n_kv_heads, head_dim
    pos = torch.arange(L, device=k.device)
    T = lens[:, None]
    valid = pos < T
    fold = valid & (pos >= sinks) & (pos <= T - window)
    fk = (torch.relu(k.float()) * fold[..., None]).view(B, L, Hkv, D).transpose(1, 2)
    vf = v.float().view(B, L, Hkv, D).transpose(1, 2)
    n = ring_size(window, sinks)
    keep = valid & ~fold      # the sinks and the last window - 1 tokens: distinct ring slots
    slot = torch.where(keep, ring_index(pos, window, sinks), n)   # slot n: spare, cut off below
    at = slot[..., None].expand(B, L, C)
    rk = v.new_zeros(B, n + 1, C).scatter(1, at, k.to(v.dtype))
    rv = v.new_zeros(B, n + 1, C).scatter(1, at, v)
    rp = torch.full((B, n + 1), -1, dtype=torch.long, device=k.device).scatter(
        1, slot, torch.where(keep, pos, -1))
    return fk.transpose(-1, -2) @ vf, fk.sum(-2), (rk[:, :n], rv[:, :n], rp[:, :n], lens.clone())


def empty_kept(B: int, C: int, device, dtype):
    """The kept keys and values of a sequence that has seen no token."""
    none = torch.zeros(B, 0, C, device=device, dtype=dtype)
    return (none, none.clone(),
            torch.zeros(0, dtype=torch.long, device=device), torch.zeros((), dtype=torch.long, device=device))


@torch.no_grad()
def mix_init(q, k, *, n_heads: int, n_kv_heads: int, head_dim: int, window: int, sinks: int,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query head, the softmax's mass on the mid tokens and the linear part's, both relative
    to the exact part's largest score, summed over these tokens (q (B, T, H*D), k (B, T, Hkv*D)):
    the log of their ratio, summed over calibration windows, is mix's starting value."""
    B, T, _ = q.shape
    Hkv, D = n_kv_heads, head_dim
    G = n_heads // Hkv
    qh = q.double().view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)
    kh = k.double().view(B, T, Hkv, D).transpose(1, 2)[:, :, None]
    pos = torch.arange(T, device=q.device)
    exact, mid = split_keys(pos, pos, window, sinks)
    sc = (qh @ kh.transpose(-1, -2)) * scale
    m = sc.masked_fill(~exact, float("-inf")).amax(-1, keepdim=True)
    soft = torch.exp(sc - m).masked_fill(~mid, 0.0).sum((-1, -2, 0))            # (Hkv, G)
    lin = ((torch.relu(qh) @ torch.relu(kh).transpose(-1, -2)) * torch.exp(-m))
    lin = lin.masked_fill(~mid, 0.0).sum((-1, -2, 0))
    return soft.reshape(-1), lin.reshape(-1)
