"""sla with a window (ops/sla_window.py): the op against its definition and against softmax
attention, the recurrent state against the whole sequence, and the pass option end to end."""
from __future__ import annotations

import math

import pytest
import torch

from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.ops.attention import causal_attention
from llmaccel.ops.sla import LinearAttentionCache, linear_attention, state_bytes
from helpers import assert_greedy_matches_logits

FAST = {"calib_samples": "2", "calib_seq_len": "32"}
HEAL = {"steps": 3, "seq_len": 16, "batch": 1, "eval_windows": 2}


def naive(q, k, v, w, mix, H, Hkv, D, K, window, sinks, eps=1e-6):
    """Query by query, head by head, from the definition (fp64)."""
    B, T, _ = q.shape
    G = H // Hkv
    out = torch.zeros(B, T, H * D, dtype=torch.float64)
    q, k, v, w, mix = q.double(), k.double(), v.double(), w.double(), mix.double()
    for b in range(B):
        for h in range(H):
            hs, js = slice(h * D, (h + 1) * D), slice((h // G) * D, (h // G + 1) * D)
            for t in range(T):
                exact = [s for s in range(t + 1) if t - s < window or s < sinks]
                mid = [s for s in range(t + 1) if s not in exact]
                sc = torch.stack([q[b, t, hs] @ k[b, s, js] for s in exact]) / math.sqrt(D)
                m = sc.max()
                e = torch.exp(sc - m)
                num = sum(e[i] * v[b, s, js] for i, s in enumerate(exact))
                den = e.sum()
                f = torch.exp(mix[h] - m)
                for s in mid:
                    a = torch.relu(q[b, t, hs]) @ torch.relu(k[b, s, js])
                    num, den = num + f * a * v[b, s, js], den + f * a
                o = num / (den + eps)
                for i in range(K):
                    s = t - (K - 1) + i
                    if s >= 0:
                        o = o + w[hs][:, i] * v[b, s, js]
                out[b, t, hs] = o
    return out.float()


def _inputs(B, T, H, Hkv, D, K, window, sinks):
    q, k, v = torch.randn(B, T, H * D), torch.randn(B, T, Hkv * D), torch.randn(B, T, Hkv * D)
    w, mix = 0.5 * torch.randn(H * D, K), torch.randn(H)
    kw = dict(layer=0, n_heads=H, n_kv_heads=Hkv, head_dim=D, kernel_size=K, eps=1e-6,
              window=window, sinks=sinks, scale=D ** -0.5)
    return q, k, v, w, mix, kw


@pytest.mark.parametrize("T,H,Hkv,D,window,sinks", [(40, 4, 2, 8, 8, 0), (33, 3, 1, 8, 5, 2),
                                                     (12, 2, 2, 4, 1, 1)])
def test_window_form_matches_its_definition(T, H, Hkv, D, window, sinks):
    q, k, v, w, mix, kw = _inputs(2, T, H, Hkv, D, 3, window, sinks)
    out = linear_attention(q, k, v, None, w, mix, **kw)
    torch.testing.assert_close(out, naive(q, k, v, w, mix, H, Hkv, D, 3, window, sinks), rtol=1e-4, atol=1e-4)


def test_a_window_as_long_as_the_sequence_is_softmax_attention():
    q, k, v, w, mix, kw = _inputs(1, 24, 4, 2, 8, 1, 24, 0)
    out = linear_attention(q, k, v, None, torch.zeros_like(w), mix, **kw)
    ref = causal_attention(q, k, v, n_heads=4, n_kv_heads=2, head_dim=8, scale=8 ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cache_decode_chunks_and_rollback_match_whole_sequence():
    q, k, v, w, mix, kw = _inputs(2, 50, 4, 2, 8, 3, 6, 2)
    whole = linear_attention(q, k, v, None, w, mix, **kw)
    for steps in ([(0, 9)] + [(t, t + 1) for t in range(9, 50)], [(0, 3), (3, 20), (20, 21), (21, 50)]):
        cache = LinearAttentionCache(2, 50, torch.float32, "cpu")
        parts = []
        for s, e in steps:
            parts.append(linear_attention(q[:, s:e], k[:, s:e], v[:, s:e], cache, w, mix, **kw))
            cache.advance(e - s)
        torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-5, atol=1e-5)
        # constant in length: S, z, the conv tail, and the sinks + window - 1 kept keys and values
        kept = 2 * (2 + 5) * 2 * 16 * 4 + (2 + 5) * 8 + 8
        assert cache.nbytes() == 2 * 2 * (8 * 8 + 8) * 4 + 2 * 2 * 16 * 4 + kept
    c = LinearAttentionCache(2, 50, torch.float32, "cpu")
    for s, e in [(0, 10), (10, 30)]:
        linear_attention(q[:, s:e], k[:, s:e], v[:, s:e], c, w, mix, **kw)
        c.advance(e - s)
    c.truncate(17)  # speculative rollback inside the last step replays its first tokens
    out = linear_attention(q[:, 17:50], k[:, 17:50], v[:, 17:50], c, w, mix, **kw)
    torch.testing.assert_close(out, whole[:, 17:50], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 5, 6, 23])
def test_a_prompt_from_the_empty_state_matches_the_step_form(T):
    """sla_forward from no state (window_whole's outputs, window_state's state) = window_forward's
    outputs and state from the empty state, for prompts shorter than the sinks and the window."""
    from llmaccel.ops.sla import sla_forward
    from llmaccel.ops.sla_window import empty_kept
    q, k, v, w, mix, kw = _inputs(2, T, 4, 2, 8, 3, 6, 2)
    kw = {key: val for key, val in kw.items() if key != "layer"}
    out, st = sla_forward(q, k, v, w, mix=mix, **kw)
    empty = (torch.zeros(2, 2, 8, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 16),
             *empty_kept(2, 16, "cpu", v.dtype))
    ref, ref_st = sla_forward(q, k, v, w, mix=mix, state=empty, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(st, ref_st):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_long_step_from_a_state_goes_in_pieces_and_matches_the_whole_sequence(monkeypatch):
    """A step of more tokens than STEP_CHUNK from a state = the whole-sequence form's outputs."""
    import llmaccel.ops.sla as sla
    monkeypatch.setattr(sla, "STEP_CHUNK", 7)
    q, k, v, w, mix, kw = _inputs(2, 40, 4, 2, 8, 3, 6, 2)
    whole = linear_attention(q, k, v, None, w, mix, **kw)
    cache = LinearAttentionCache(2, 40, torch.float32, "cpu")
    first = linear_attention(q[:, :5], k[:, :5], v[:, :5], cache, w, mix, **kw)
    cache.advance(5)
    rest = linear_attention(q[:, 5:], k[:, 5:], v[:, 5:], cache, w, mix, **kw)   # 35 tokens, 5 pieces
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=1e-5, atol=1e-5)


# window 6, sinks 2: 7 kept tokens from 7 seen on; (1, 3, 8): rows filling the sinks and the ring
# beside one whose first token leaves the window; window 1: only sinks are kept; no sinks
@pytest.mark.parametrize("lengths,window,sinks", [((30, 45, 60), 6, 2), ((1, 3, 8, 7), 6, 2),
                                                  ((1, 2, 9), 1, 2), ((1, 5, 6, 20), 6, 0)],
                         ids=["steady", "filling", "window-1", "no-sinks"])
def test_decode_rows_in_the_ring_form_match_each_row_alone(lengths, window, sinks):
    """One token of several sequences, each at its own position, from their states in the ring
    form stacked (ring_decode through sla_forward) = each sequence's step alone (window_forward),
    and the states after it are the ring forms of the states each step alone leaves."""
    from llmaccel.ops.sla import sla_forward
    from llmaccel.ops.sla_window import from_ring, to_ring
    q, k, v, w, mix, kw = _inputs(len(lengths), 61, 4, 2, 8, 3, window, sinks)
    kw = {key: val for key, val in kw.items() if key != "layer"}
    rings, alone = [], []
    for b, n in enumerate(lengths):
        _, st = sla_forward(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], w, mix=mix, **kw)
        ring = to_ring(st[3:], window, sinks)
        back = from_ring(ring)   # the ring form holds the same kept tokens
        assert torch.equal(back[2], st[5]) and torch.equal(back[0], st[3]) and int(back[3]) == n
        rings.append((*st[:3], *ring))
        alone.append(sla_forward(q[b:b + 1, n:n + 1], k[b:b + 1, n:n + 1], v[b:b + 1, n:n + 1], w,
                                 mix=mix, state=st, **kw))
    stacked = tuple(torch.cat([r[j] for r in rings]) for j in range(7))
    rows = torch.tensor(lengths)
    pick = (lambda x: x[torch.arange(len(lengths)), rows][:, None])
    out, new = sla_forward(pick(q), pick(k), pick(v), w, mix=mix, state=stacked, **kw)
    for b, (o, st) in enumerate(alone):
        torch.testing.assert_close(out[b:b + 1], o, rtol=1e-5, atol=1e-5)
        want = (*st[:3], *to_ring(st[3:], window, sinks))
        for j in range(5):
            torch.testing.assert_close(new[j][b:b + 1], want[j], rtol=1e-5, atol=1e-5)
        assert torch.equal(new[5][b:b + 1], want[5]) and int(new[6][b]) == int(want[6][0]) == lengths[b] + 1


@pytest.mark.parametrize("window,sinks", [(0, 0), (6, 2), (1, 2), (5, 0)],
                         ids=["no-window", "window", "window-1", "no-sinks"])
def test_prompts_padded_to_one_length_match_each_prompt_alone(window, sinks):
    """New prompts of different lengths right-padded with zeros into one call (prompts_forward)
    = each prompt's sla_forward alone: its outputs and its state after its own tokens (in the
    ring form with a window; the conv's tail of a prompt shorter than the kernel included)."""
    from llmaccel.ops.sla import prompts_forward, sla_forward
    from llmaccel.ops.sla_window import to_ring
    lengths = (2, 17, 1, 12)
    q, k, v, w, mix, kw = _inputs(len(lengths), max(lengths), 4, 2, 8, 3, max(window, 1), sinks)
    kw = {key: val for key, val in kw.items() if key != "layer"}
    if not window:
        kw = {key: val for key, val in kw.items() if key not in ("window", "sinks", "scale")}
        mix = None
    valid = torch.arange(max(lengths))[None, :, None] < torch.tensor(lengths)[:, None, None]
    out, st = prompts_forward(*(x * valid for x in (q, k, v)), torch.tensor(lengths), w, mix=mix, **kw)
    for b, n in enumerate(lengths):
        o, want = sla_forward(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], w, mix=mix, **kw)
        if window:
            want = (*want[:3], *to_ring(want[3:], window, sinks))
        torch.testing.assert_close(out[b:b + 1, :n], o, rtol=1e-5, atol=1e-5)
        assert len(st) == len(want)
        for got, x in zip(st, want):
            torch.testing.assert_close(got[b:b + 1], x, rtol=1e-5, atol=1e-5)


def test_window_needs_its_mix_weight():
    q, k, v, w, mix, kw = _inputs(1, 8, 2, 1, 4, 2, 4, 0)
    with pytest.raises(LlmaccelError, match="mix weight"):
        linear_attention(q, k, v, None, w, None, **kw)


def test_pass_with_a_window_fits_mix_heals_and_generates(tmp_path):
    opts = {"sla": {**FAST, "window": "8", "sinks": "1"}}
    base = compile("preset:tiny-llama", ["sla"], {"sla": FAST}, progress=False, eval_tokens=0)
    m0 = compile("preset:tiny-llama", ["sla"], opts, progress=False, eval_tokens=0)
    c = m0.config
    st = m0.report["passes"][-1]["stats"]
    assert (st["window"], st["sinks"]) == (8, 1)
    assert st["state_bytes_per_sequence"] == c.n_layers * state_bytes(c.n_kv_heads, c.head_dim, 4,
                                                                      window=8, sinks=1)
    mix0 = m0.gm.get_parameter("layers.0.sla_mix.weight")
    assert mix0.shape == (c.n_heads,) and torch.isfinite(mix0).all()
    # exact attention over the window explains more of softmax attention than linear attention alone
    assert st["attn_rel_err_fit"] < st["attn_rel_err_linear"]
    assert st["attn_rel_err_fit"] < base.report["passes"][-1]["stats"]["attn_rel_err_fit"]
    m = compile("preset:tiny-llama", ["sla", "heal"], {**opts, "heal": HEAL}, calib="self",
                eval_tokens=0, progress=False)
    assert not torch.equal(m.gm.get_parameter("layers.0.sla_mix.weight"), mix0)  # heal trained it
    # greedy generation through the recurrent state (past the window) = the whole-sequence argmax
    assert_greedy_matches_logits(m, [1, 5, 9, 2], 14)
    m.save(tmp_path / "a", m.report)
    back = load(str(tmp_path / "a"))
    ids = torch.randint(0, 512, (2, 19))
    torch.testing.assert_close(back.logits(ids), m.logits(ids), rtol=0, atol=0)


@pytest.mark.parametrize("opts,match", [({"window": "-1"}, "sla.window"), ({"sinks": "2"}, "sla.sinks")])
def test_bad_window_options(opts, match):
    with pytest.raises(LlmaccelError, match=match):
        compile("preset:tiny-llama", ["sla"], {"sla": {**FAST, **opts}}, progress=False, eval_tokens=0)


def test_whole_sequence_form_traces_to_the_same_graph_size_at_any_length():
    """Chunks of the window, no loop over them: heal compiles the traced forward and backward."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def nodes(T):
        q, k, v, w, mix, kw = _inputs(1, T, 4, 2, 8, 3, 16, 2)
        fx = make_fx(lambda *a: linear_attention(*a[:3], None, a[3], a[4], **kw))(q, k, v, w, mix)
        return len(fx.graph.nodes)
    assert nodes(64) == nodes(256) == nodes(1024) and nodes(100) == nodes(300)  # (these two pad)
