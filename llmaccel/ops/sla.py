"""SLA (SLAB): simplified linear attention, the IR op and its constant-size recurrent cache.

    out_t = phi(q_t) S_t / (phi(q_t) . z_t + eps) + DWC(v)_t,   phi = ReLU,
    S_t = sum_{s<=t} phi(k_s)^T v_s,   z_t = sum_{s<=t} phi(k_s)

per query head h, reading KV head h // (n_heads / n_kv_heads) (GQA). DWC is a causal depthwise
1-D convolution over tokens: out[t, c] = sum_j w[c, j] * v[t - (K-1) + j, c] (tap K-1 is the
current token), with v broadcast to the query heads first when the weight has n_heads * head_dim
rows (one filter per query head; the pass's choice) or applied per KV channel when it has
n_kv_heads * head_dim rows. The state math (S, z, the attention itself) runs in fp32 whatever the
input dtype: S and z are sums over the whole history.

With ctx None the op is the whole-sequence causal form, computed chunk by chunk (intra-chunk
masked phi(q) phi(k)^T v plus the running state), differentiable for heal. With a context the
op calls `ctx.linear_attend`: LinearAttentionCache keeps, per layer, S (B, Hkv, D, D), z (B, Hkv, D)
and the last K-1 values, so a decode step costs the same at any length.

With `window` > 0 the op is the sliding-window hybrid of ops/sla_window.py: exact softmax over
the last `window` tokens and the first `sinks`, this linear attention over the tokens between,
one normalizer, a per-head log-scale `mix` (an extra weight argument); its state also keeps
those tokens' keys and values.
"""
from __future__ import annotations

import torch
import torch.fx

from llmaccel.errors import LlmaccelError
from llmaccel.ops.context import StepContext
from llmaccel.ops.sla_window import (empty_kept, ring_decode, ring_state, to_ring, window_forward,
                                     window_state, window_state_bytes, window_whole)

CHUNK = 64  # tokens per chunk of the whole-sequence form (memory O(T * CHUNK), not O(T^2))
# tokens per window_forward call from a state: a prefill chunk of thousands of tokens (the engine's
# step budget) would otherwise score all of them against each other (an 8,192-token chunk of
# SmolLM2: 2.4 GB of fp32 scores per tensor), where at most window + sinks keys are exact
STEP_CHUNK = 512

__all__ = ["linear_attention", "sla_forward", "prompts_forward", "empty_state", "LinearAttentionCache", "state_bytes"]


def _init_state(B: int, Hkv: int, D: int, C: int, K: int, device, dtype):
    S = torch.zeros(B, Hkv, D, D, device=device, dtype=torch.float32)
    z = torch.zeros(B, Hkv, D, device=device, dtype=torch.float32)
    tail = torch.zeros(B, K - 1, C, device=device, dtype=dtype)
    return S, z, tail


def empty_state(B: int, *, n_kv_heads: int, head_dim: int, kernel_size: int, window: int = 0,
                sinks: int = 0, dtype, device, **_) -> tuple[torch.Tensor, ...]:
    """The state of B sequences that have seen no token, with a window's kept tokens in the ring
    form (ops/sla_window.to_ring): the shapes and dtypes a step from states of B rows returns."""
    Hkv, D = n_kv_heads, head_dim
    state = _init_state(B, Hkv, D, Hkv * D, kernel_size, device, dtype)
    if window:
        state = (*state, *to_ring(empty_kept(B, Hkv * D, device, dtype), window, sinks))
    return state


def _la_chunks(q, k, v, S, z, eps: float, chunk: int = CHUNK):
    """Normalized causal linear attention from state (S, z). q (B, Hkv, G, T, D) and k, v
    (B, Hkv, T, D) already feature-mapped, fp32. Returns (out (B, Hkv, G, T, D), S, z).

    All chunks at once: each chunk's state increment k_c^T v_c, an exclusive cumulative sum over
    chunks for the state each chunk starts from, the masked intra-chunk part batched. No loop
    over chunks, so the traced graph (heal compiles it with Inductor) has the same size at any
    length; zero padding to whole chunks adds nothing (phi(0) = 0 keys, discarded queries).
    """
    B, Hkv, G, T, D = q.shape
    c = min(chunk, T)
    N = -(-T // c)
    pad = N * c - T
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
        k = torch.nn.functional.pad(k, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    qc = q.reshape(B, Hkv, G, N, c, D)
    kc, vc = k.reshape(B, Hkv, N, c, D), v.reshape(B, Hkv, N, c, D)
    dS = kc.transpose(-1, -2) @ vc                                       # (B, Hkv, N, D, D)
    dz = kc.sum(-2)                                                      # (B, Hkv, N, D)
    S_incl, z_incl = S[:, :, None] + dS.cumsum(2), z[:, :, None] + dz.cumsum(2)
    S_start, z_start = S_incl - dS, z_incl - dz                         # state before each chunk
    mask = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    A = (qc @ kc[:, :, None].transpose(-1, -2)).masked_fill(~mask, 0.0)  # (B, Hkv, G, N, c, c)
    num = A @ vc[:, :, None] + qc @ S_start[:, :, None]
    den = A.sum(-1, keepdim=True) + qc @ z_start[:, :, None, :, :, None]
    out = (num / (den + eps)).reshape(B, Hkv, G, N * c, D)[..., :T, :]
    return out, S_incl[:, :, -1], z_incl[:, :, -1]


def _expand_v(v: torch.Tensor, n_kv_heads: int, group: int, head_dim: int) -> torch.Tensor:
    """(B, T, Hkv * D) -> (B, T, H * D): KV head j serves query heads j*G .. j*G + G - 1."""
    B, T, _ = v.shape
    if group == 1:
        return v
    # the width spelled out: with kernel_size 1 the conv's history has T = 0
    return v.view(B, T, n_kv_heads, 1, head_dim).expand(B, T, n_kv_heads, group, head_dim).reshape(
        B, T, n_kv_heads * group * head_dim)


def _dwconv(x: torch.Tensor, w: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv of x (B, T, C) with w (C, K), after `tail` (B, K-1, C) of history."""
    T, K = x.shape[1], w.shape[1]
    xp = torch.cat([tail.to(x.dtype), x], 1)
    out = xp[:, 0:T] * w[:, 0]
    for j in range(1, K):
        out = out + xp[:, j:j + T] * w[:, j]
    return out


def sla_forward(q, k, v, conv_weight, *, n_heads: int, n_kv_heads: int, head_dim: int,
                kernel_size: int, eps: float, window: int = 0, sinks: int = 0,
                scale: float | None = None, mix: torch.Tensor | None = None, state=None,
                with_state: bool = True):
    """The op's math from a recurrent state (None = empty). Returns (out, new state).

    q (B, T, H*D), k and v (B, T, Hkv*D), conv_weight (H*D or Hkv*D, kernel_size).
    state = (S (B, Hkv, D, D) fp32, z (B, Hkv, D) fp32, tail (B, K-1, Hkv*D) last values), and
    with a window the kept keys, values, their positions and the count of tokens seen.
    with_state False: the caller discards the returned state (the whole-sequence form), so a
    window need not compute it. With a window, a state of B sequences in the ring form (positions
    (B, L), seen (B,); ops/sla_window.to_ring) steps one token of each at once (ring_decode).
    """
    B, T, _ = q.shape
    H, Hkv, D, K = n_heads, n_kv_heads, head_dim, kernel_size
    if H % Hkv:
        raise LlmaccelError(f"linear_attention: n_heads {H} is not a multiple of n_kv_heads {Hkv}")
    G = H // Hkv
    if conv_weight.shape[1] != K or conv_weight.shape[0] not in (H * D, Hkv * D):
        raise LlmaccelError(f"linear_attention: conv_weight is {tuple(conv_weight.shape)}; expected "
                            f"({H * D} or {Hkv * D}, {K})")
    if window and (mix is None or mix.numel() != H):
        raise LlmaccelError(f"linear_attention: a window needs a mix weight of {H} values")
    whole = state is None
    if whole:
        state = _init_state(B, Hkv, D, Hkv * D, K, q.device, v.dtype)
        if window:
            state = (*state, *empty_kept(B, Hkv * D, q.device, v.dtype))
    S, z, tail = state[:3]
    kept = ()
    if window:
        wkw = dict(n_heads=H, n_kv_heads=Hkv, head_dim=D, window=window, sinks=sinks,
                   scale=D ** -0.5 if scale is None else scale, eps=eps)
        if whole:   # chunked; without a state out nothing is shaped by the data: heal traces it
            o = window_whole(q, k, v, mix, **wkw)
            if with_state:
                S, z, kept = window_state(k, v, n_kv_heads=Hkv, head_dim=D, window=window, sinks=sinks)
        elif state[5].dim() == 2:  # positions (B, L): B sequences' states in the ring form, one token each
            o, S, z, kept = ring_decode(q, k, v, mix, S=S, z=z, ring=tuple(state[3:]), **wkw)
        else:  # from a state: STEP_CHUNK tokens at a time, each scored against itself and the kept
            kept, parts = tuple(state[3:]), []
            for i in range(0, T, STEP_CHUNK):
                part, S, z, kept = window_forward(q[:, i:i + STEP_CHUNK], k[:, i:i + STEP_CHUNK],
                                                  v[:, i:i + STEP_CHUNK], mix, S=S, z=z, kept=kept, **wkw)
                parts.append(part)
            o = torch.cat(parts, 1)
    else:
        qh = torch.relu(q.float()).view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)
        kh = torch.relu(k.float()).view(B, T, Hkv, D).transpose(1, 2)
        vh = v.float().view(B, T, Hkv, D).transpose(1, 2)
        o, S, z = _la_chunks(qh, kh, vh, S, z, eps)
        o = o.permute(0, 3, 1, 2, 4).reshape(B, T, H * D)
    vt = torch.cat([tail.to(v.dtype), v], 1)                        # (B, K-1+T, Hkv*D)
    w = conv_weight.float()
    if w.shape[0] == H * D:
        conv = _dwconv(_expand_v(v.float(), Hkv, G, D), w, _expand_v(tail.float(), Hkv, G, D))
    else:
        conv = _expand_v(_dwconv(v.float(), w, tail.float()), Hkv, G, D)
    new_tail = vt[:, vt.shape[1] - (K - 1):]
    return (o + conv).to(q.dtype), (S, z, new_tail, *kept)


def prompts_forward(q, k, v, lens: torch.Tensor, conv_weight, *, kernel_size: int, window: int = 0,
                    sinks: int = 0, **kw):
    """sla_forward from the empty state for B prompts right-padded with zeros to one length L,
    lens (B,) their own lengths: the outputs (B, L, H*D; those past a row's length are padding's)
    and each row's state after its own tokens (with a window, in the ring form). One call for
    every prompt of a step (causal, so the padding changes no real token's output; zero keys add
    nothing to S and z). Equal to sla_forward row by row (tested)."""
    B, L, C = v.shape
    out, state = sla_forward(q, k, v, conv_weight, kernel_size=kernel_size, window=window,
                             sinks=sinks, with_state=not window, **kw)
    S, z, ring = *state[:2], ()
    if window:
        S, z, ring = ring_state(k, v, lens, n_kv_heads=kw["n_kv_heads"], head_dim=kw["head_dim"],
                                window=window, sinks=sinks)
    # the last K-1 values of each row (zeros before its first token), as sla_forward's tail
    vt = torch.nn.functional.pad(v, (0, 0, kernel_size - 1, 0))
    at = lens[:, None] + torch.arange(kernel_size - 1, device=v.device)
    tail = vt.gather(1, at[..., None].expand(B, kernel_size - 1, C))
    return out, (S, z, tail, *ring)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx,
                     conv_weight: torch.Tensor, mix: torch.Tensor | None = None, *, layer: int,
                     n_heads: int, n_kv_heads: int, head_dim: int, kernel_size: int, eps: float,
                     window: int = 0, sinks: int = 0, scale: float | None = None) -> torch.Tensor:
    """SLA in place of `attention`, on (B, T, H * head_dim) inputs (see the module docstring).

    ctx None: the whole-sequence causal form. Otherwise the context keeps this layer's recurrent
    state (LinearAttentionCache, built by llmaccel.compiler.executor.make_cache).
    """
    kw = dict(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
              kernel_size=kernel_size, eps=eps)
    if window:
        kw.update(window=window, sinks=sinks, scale=scale, mix=mix)
    if ctx is None:
        return sla_forward(q, k, v, conv_weight, with_state=False, **kw)[0]
    return ctx.linear_attend(layer, q, k, v, conv_weight, **kw)


torch.fx.wrap("linear_attention")


def state_bytes(n_kv_heads: int, head_dim: int, kernel_size: int, dtype_bytes: int = 2,
                window: int = 0, sinks: int = 0) -> int:
    """Recurrent state of one layer for one sequence: S and z in fp32, K-1 values in the model
    dtype, and with a window the kept keys and values."""
    return n_kv_heads * (head_dim * head_dim + head_dim) * 4 + \
        (kernel_size - 1) * n_kv_heads * head_dim * dtype_bytes + \
        (window_state_bytes(n_kv_heads, head_dim, window, sinks, dtype_bytes) if window else 0)


class LinearAttentionCache(StepContext):
    """Attention context for sla graphs in the reference executor (ContiguousKVCache's protocol).

    A forward of T tokens computes each layer's state after them from the committed state (so a
    re-run of the same step recomputes it); `advance(T)` commits. `truncate(n)` (speculative
    rollback) goes back inside the last `keep` steps by restoring the state before a step and
    replaying its first tokens' keys and values; further back raises: a recurrent state cannot
    forget tokens.
    """

    def __init__(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
                 keep: int = 2):
        self.batch, self.max_len, self.dtype, self.device, self.keep = batch, max_len, dtype, device, keep
        self.length = 0
        self.state: dict[int, tuple] = {}
        self._pending: dict[int, tuple] = {}    # layer -> (new state, state before, k, v, kwargs)
        self._pending_len = 0
        self._history: list[tuple[int, int, dict]] = []  # (start, tokens, layer -> (before, k, v, kw))

    def linear_attend(self, layer, q, k, v, conv_weight, **kw):
        T = q.shape[1]
        if self.length + T > self.max_len:
            raise ValueError(f"cache holds {self.max_len} tokens; {self.length + T} requested")
        before = self.state.get(layer)
        out, new = sla_forward(q, k, v, conv_weight, state=before, **kw)
        self._pending[layer] = (new, before, k, v, kw)
        self._pending_len = T
        return out

    def advance(self, n: int) -> None:
        if self._pending and n != self._pending_len:
            raise ValueError(f"advance({n}) after a forward of {self._pending_len} tokens")
        step = {}
        for layer, (new, before, k, v, kw) in self._pending.items():
            self.state[layer] = new
            step[layer] = (before, k, v, kw)
        self._history = (self._history + [(self.length, n, step)])[-self.keep:]
        self._pending.clear()
        self.length += n

    def truncate(self, n: int) -> None:
        self._pending.clear()
        if n == self.length:
            return
        if n > self.length:
            raise ValueError(f"truncate({n}) beyond the {self.length} tokens held")
        for i in range(len(self._history) - 1, -1, -1):
            start, T, step = self._history[i]
            if start <= n < start + T:
                break
        else:
            raise LlmaccelError(f"linear attention (sla) keeps a recurrent state, not a KV cache: it "
                                f"can roll back only within its last {self.keep} steps, not from "
                                f"{self.length} to {n} tokens")
        m = n - start
        kept = {}
        for layer, (before, k, v, kw) in step.items():
            self.state[layer] = replay(before, k[:, :m], v[:, :m], **kw) if m else before
            kept[layer] = (before, k[:, :m], v[:, :m], kw)
            if before is None and not m:
                del self.state[layer]
        self._history = self._history[:i] + ([(start, m, kept)] if m else [])
        self.length = n

    def nbytes(self) -> int:
        return sum(t.nbytes for st in self.state.values() for t in st)


def replay(state, k, v, *, n_heads, n_kv_heads, head_dim, kernel_size, **kw):
    """The state after feeding k, v (B, m, Hkv*D) on top of `state` (None = empty)."""
    B, m, _ = k.shape
    q = k.new_zeros(B, m, n_heads * head_dim)  # outputs are discarded; only the state matters
    w = k.new_zeros(n_kv_heads * head_dim, kernel_size)
    return sla_forward(q, k, v, w, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                       kernel_size=kernel_size, state=state, **kw)[1]
