"""sla (SLAB simplified linear attention): the op against a naive O(T^2) loop, the recurrent
cache against the whole-sequence form, the pass on tiny presets, heal, generation, artifacts.

Tolerances: fp32 throughout. The chunked form and the cache run the same math in another
summation order than the naive loop: 1e-5 relative (atol 1e-5 on outputs of order 1).
"""
import pytest
import torch

from llmaccel.compiler import executor
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.ops.attention import ContiguousKVCache
from llmaccel.ops.sla import LinearAttentionCache, linear_attention, sla_forward, state_bytes
from helpers import assert_greedy_matches_logits

FAST = {"sla": {"calib_samples": "2", "calib_seq_len": "32"}}
HEAL = {"steps": 3, "seq_len": 16, "batch": 1, "eval_windows": 2}


def naive(q, k, v, w, H, Hkv, D, K, eps):
    """Token by token, head by head, straight from the definition."""
    B, T, _ = q.shape
    G = H // Hkv
    out = torch.zeros(B, T, H * D, dtype=torch.float64)
    q, k, v, w = q.double(), k.double(), v.double(), w.double()
    for b in range(B):
        for h in range(H):
            j, hs, js = h // G, slice(h * D, (h + 1) * D), slice((h // G) * D, (h // G + 1) * D)
            wr = w[hs] if w.shape[0] == H * D else w[js]
            for t in range(T):
                a = torch.relu(k[b, :t + 1, js]) @ torch.relu(q[b, t, hs])
                o = (a @ v[b, :t + 1, js]) / (a.sum() + eps)
                for i in range(K):
                    s = t - (K - 1) + i
                    if s >= 0:
                        o = o + wr[:, i] * v[b, s, js]
                out[b, t, hs] = o
    return out.float()


def _inputs(B, T, H, Hkv, D, K, rows):
    q, k, v = torch.randn(B, T, H * D), torch.randn(B, T, Hkv * D), torch.randn(B, T, Hkv * D)
    w = 0.5 * torch.randn((H if rows == "q" else Hkv) * D, K)
    kw = dict(layer=0, n_heads=H, n_kv_heads=Hkv, head_dim=D, kernel_size=K, eps=1e-6)
    return q, k, v, w, kw


@pytest.mark.parametrize("B,T,H,Hkv,D,K,rows", [(1, 70, 4, 2, 8, 4, "q"), (1, 130, 3, 1, 16, 3, "kv"),
                                                (1, 9, 2, 2, 8, 1, "q")])
def test_causal_form_matches_naive_loop(B, T, H, Hkv, D, K, rows):
    q, k, v, w, kw = _inputs(B, T, H, Hkv, D, K, rows)
    out = linear_attention(q, k, v, None, w, **kw)
    torch.testing.assert_close(out, naive(q, k, v, w, H, Hkv, D, K, 1e-6), rtol=1e-5, atol=1e-5)


def test_causal_form_traces_to_the_same_graph_size_at_any_length():
    """No loop over chunks: heal compiles the traced forward and backward, and a graph that grew
    with the window (8 chunk bodies per layer at 512 tokens) took Inductor minutes to compile."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def nodes(T):
        q, k, v, w, kw = _inputs(1, T, 4, 2, 8, 4, "q")
        return len(make_fx(lambda *a: linear_attention(*a[:3], None, a[3], **kw))(q, k, v, w).graph.nodes)
    assert nodes(128) == nodes(512) == nodes(2048) and nodes(200) == nodes(1000)  # (these two pad)


def test_cache_decode_and_chunked_prefill_match_whole_sequence():
    q, k, v, w, kw = _inputs(2, 90, 6, 2, 8, 4, "q")
    whole = linear_attention(q, k, v, None, w, **kw)
    for steps in ([(0, 20)] + [(t, t + 1) for t in range(20, 90)],        # prefill + decode
                  [(0, 7), (7, 8), (8, 41), (41, 42), (42, 90)]):          # chunked prefill
        cache = LinearAttentionCache(2, 90, torch.float32, "cpu")
        parts = []
        for s, e in steps:
            parts.append(linear_attention(q[:, s:e], k[:, s:e], v[:, s:e], cache, w, **kw))
            cache.advance(e - s)
        torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-5, atol=1e-5)
        # the state is constant in size: S, z and K-1 values per layer
        assert cache.nbytes() == 2 * 2 * (8 * 8 + 8) * 4 + 2 * 3 * 16 * 4


def test_cache_rerun_truncate_and_rollback_limit():
    q, k, v, w, kw = _inputs(1, 30, 2, 1, 8, 3, "q")
    whole = linear_attention(q, k, v, None, w, **kw)

    def step(cache, s, e):
        out = linear_attention(q[:, s:e], k[:, s:e], v[:, s:e], cache, w, **kw)
        cache.advance(e - s)
        return out

    c = LinearAttentionCache(1, 30, torch.float32, "cpu")
    step(c, 0, 10)
    linear_attention(q[:, 10:12], k[:, 10:12], v[:, 10:12], c, w, **kw)  # a step never advanced
    step(c, 10, 16)                                                       # is recomputed, not added
    c.truncate(13)  # speculative rollback inside the last step: replay its first 3 tokens
    assert c.length == 13
    torch.testing.assert_close(step(c, 13, 20), whole[:, 13:20], rtol=1e-5, atol=1e-5)
    c.truncate(16)  # back to a step boundary inside the kept history
    torch.testing.assert_close(step(c, 16, 30), whole[:, 16:30], rtol=1e-5, atol=1e-5)
    with pytest.raises(LlmaccelError, match="roll back only within its last 2 steps"):
        c.truncate(5)


def test_fp16_inputs_keep_fp32_state():
    q, k, v, w, kw = _inputs(1, 64, 2, 1, 16, 4, "q")
    out, (S, z, tail) = sla_forward(q.half(), k.half(), v.half(), w.half(),
                                    **{x: y for x, y in kw.items() if x != "layer"})
    assert out.dtype == torch.float16 and S.dtype == z.dtype == torch.float32 and tail.shape == (1, 3, 16)
    ref = linear_attention(q.half().float(), k.half().float(), v.half().float(), None, w.half().float(), **kw)
    torch.testing.assert_close(out.float(), ref, rtol=1e-3, atol=1e-3)


def test_op_refuses_a_kv_cache():
    q, k, v, w, kw = _inputs(1, 4, 2, 1, 8, 3, "q")
    with pytest.raises(LlmaccelError, match="make_cache"):
        linear_attention(q, k, v, ContiguousKVCache(1, 4, torch.float32, "cpu"), w, **kw)


# --- the pass -----------------------------------------------------------------------------------

@pytest.mark.parametrize("src,passes", [("preset:tiny-llama", ["sla"]), ("preset:tiny-gpt2", ["fuse", "sla"])])
def test_pass_replaces_attention_and_reports_bytes(src, passes):
    m = compile(src, passes, FAST, progress=False, eval_tokens=0)
    c = m.config
    counts = m.op_counts()
    assert counts.get("attention", 0) == 0 and counts["linear_attention"] == c.n_layers
    st = m.report["passes"][-1]["stats"]
    assert st["layers"] == st["attention_ops_replaced"] == c.n_layers
    assert st["kv_bytes_per_token_before"] == 2 * c.n_kv_heads * c.head_dim * c.n_layers * 2
    assert st["state_bytes_per_sequence"] == c.n_layers * state_bytes(c.n_kv_heads, c.head_dim, 4)
    # the fitted conv explains part of what linear attention misses of softmax attention
    assert st["attn_rel_err_fit"] <= st["attn_rel_err_linear"]
    assert m.gm.get_parameter("layers.0.sla_conv.weight").shape == (c.n_heads * c.head_dim, 4)
    # the fitted per-channel gain went into W_o's columns
    assert st["gain_folded_layers"] == c.n_layers
    assert not torch.equal(m.gm.get_parameter("layers.0.o.weight"), load(src).gm.get_parameter("layers.0.o.weight"))
    assert isinstance(executor.make_cache(m.gm, 1, 8, torch.float32), LinearAttentionCache)


def test_fit_without_gain_keeps_w_o():
    m = compile("preset:tiny-llama", ["sla"], {"sla": {**FAST["sla"], "gain": "false"}},
                progress=False, eval_tokens=0)
    st = m.report["passes"][0]["stats"]
    assert st["gain_folded_layers"] == 0 and st["attn_rel_err_fit"] <= st["attn_rel_err_linear"]
    assert torch.equal(m.gm.get_parameter("layers.1.o.weight"),
                       load("preset:tiny-llama").gm.get_parameter("layers.1.o.weight"))


def test_zeros_init_is_pure_linear_attention():
    m = compile("preset:tiny-llama", ["sla"], {"sla": {"init": "zeros", "kernel_size": "3"}},
                progress=False, eval_tokens=0)
    w = m.gm.get_parameter("layers.1.sla_conv.weight")
    assert w.shape[1] == 3 and not w.any()
    assert m.report["passes"][0]["stats"]["init"] == "zeros"


@pytest.mark.parametrize("opts,match", [({"kernel_size": "0"}, "kernel_size"), ({"eps": "0"}, "eps"),
                                        ({"init": "ones"}, "expected one of fit|zeros")])
def test_bad_options(opts, match):
    with pytest.raises(LlmaccelError, match=match):
        compile("preset:tiny-llama", ["sla"], {"sla": opts}, progress=False, eval_tokens=0)


def test_nothing_left_to_replace():
    from llmaccel.compiler.registry import get_pass
    from llmaccel.passes.base import PassContext, Progress, make_config

    m = compile("preset:tiny-llama", ["sla"], {"sla": {"init": "zeros"}}, progress=False, eval_tokens=0)
    sla = get_pass("sla")(make_config(get_pass("sla"), {"init": "zeros"}))
    with pytest.raises(LlmaccelError, match="no softmax attention"):
        sla.run(m.gm, PassContext(m.config, progress=Progress(False)))


@pytest.mark.parametrize("src", ["preset:tiny-llama", "preset:tiny-gpt2"])
def test_sla_heal_trains_conv_and_generates(src, tmp_path):
    m0 = compile(src, ["sla"], FAST, progress=False, eval_tokens=0)
    m = compile(src, ["sla", "heal"], {**FAST, "heal": HEAL}, calib="self", eval_tokens=0, progress=False)
    w0, w1 = (x.gm.get_parameter("layers.0.sla_conv.weight") for x in (m0, m))
    assert not torch.equal(w0, w1)  # heal trained the conv
    assert m.report["passes"][1]["stats"]["steps"] == 3
    # greedy generation through the recurrent cache = argmax of the whole-sequence forward
    assert_greedy_matches_logits(m, [1, 5, 9, 2], 10)
    # artifact round trip: same graph, same logits
    m.save(tmp_path / "a", m.report)
    back = load(str(tmp_path / "a"))
    assert back.op_counts() == m.op_counts()
    ids = torch.randint(0, 512, (2, 19))
    torch.testing.assert_close(back.logits(ids), m.logits(ids), rtol=0, atol=0)

