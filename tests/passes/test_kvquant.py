"""kvquant (KIVI): the format's references, the quantized cache, the pass, chunked eval.

Tolerances: fp32 throughout; "exact" comparisons allow fp32 rounding (1e-5 relative) where the
same math runs in a different order, and quantization errors are bounded by half a step.
"""
import json

import pytest
import torch

from llmaccel import cli, ops
from llmaccel.compiler import executor
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.eval.perplexity import evaluate
from llmaccel.ops import kvquant as kq
from llmaccel.ops.attention import ContiguousKVCache, attend_heads, merge_heads, split_heads
from llmaccel.sampling import SamplingParams

SMALL = {"kvquant": {"bits": "4", "group": "4", "residual": "8"}}


def _kvq(bits=4, group=4, residual=8, src="preset:tiny-llama"):
    opts = {"kvquant": {"bits": str(bits), "group": str(group), "residual": str(residual)}}
    return compile(src, ["kvquant"], opts, progress=False, eval_tokens=0)


# --- format references ---------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 2])
def test_pack_roundtrip_and_layout(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 16), dtype=torch.uint8)
    packed = kq.pack(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8) and torch.equal(kq.unpack(packed, bits), codes)
    per = 8 // bits  # element per*j + i sits in bits [i*bits, (i+1)*bits) of byte j
    assert int(packed[0, 0, 0]) == sum(int(codes[0, 0, i]) << (i * bits) for i in range(per))


@pytest.mark.parametrize("bits", [4, 2])
def test_quantize_error_is_at_most_half_a_step(bits):
    x = torch.randn(2, 3, 64, 32) * torch.rand(1, 1, 1, 32) * 10  # channels of different scales
    kp, ks, km = kq.quantize_keys(x, bits, 16)
    assert ks.shape == (2, 3, 4, 32)  # per channel, per group of 16 tokens
    err = (kq.dequantize_keys(kp, ks, km, bits, 16) - x).abs()
    assert (err <= ks.repeat_interleave(16, -2) / 2 + 1e-5).all()
    vp, vs, vm = kq.quantize_values(x, bits, 8)
    assert vs.shape == (2, 3, 64, 4)  # per token, per group of 8 channels
    err = (kq.dequantize_values(vp, vs, vm, bits, 8) - x).abs()
    assert (err <= vs.repeat_interleave(8, -1) / 2 + 1e-5).all()
    const = torch.full((1, 16, 8), 3.0)  # a flat group: zero scale, exact
    assert torch.equal(kq.dequantize_keys(*kq.quantize_keys(const, bits, 16), bits, 16), const)


# --- the quantized cache ---------------------------------------------------------------------------

def test_cache_keeps_recent_tokens_exact_and_ages_groups():
    spec = kq.make_spec(4, 4, 8, 16)
    cache = kq.QuantizedKVCache(1, 40, torch.float32, "cpu", {0: spec})
    H, D, Hq = 2, 16, 4
    ks, vs = torch.randn(1, 30, H * D), torch.randn(1, 30, H * D)
    kw = dict(n_heads=Hq, n_kv_heads=H, head_dim=D, scale=0.25)
    for s, t in ((0, 5), (5, 6), (11, 1), (12, 13), (25, 5)):  # chunked prefill, then decode
        q = torch.randn(1, t, Hq * D)
        out = cache.attend(0, q, ks[:, s:s + t], vs[:, s:s + t], **kw)
        cache.advance(t)
        L = s + t
        st = cache.layers[0]
        assert st.n_q == kq.quantized_len(L, spec) == 4 * (max(0, L - 8) // 4)
        assert st.kr.shape[2] == L - st.n_q
        kh, vh = split_heads(ks[:, :L], H, D), split_heads(vs[:, :L], H, D)
        nq = st.n_q
        kd = kq.dequantize_keys(*kq.quantize_keys(kh[:, :, :nq], 4, 4), 4, 4)
        vd = kq.dequantize_values(*kq.quantize_values(vh[:, :, :nq], 4, 4), 4, 4)
        K, V = torch.cat([kd, kh[:, :, nq:]], 2), torch.cat([vd, vh[:, :, nq:]], 2)
        mask = torch.arange(L)[None, :] <= torch.arange(s, L)[:, None]
        exp = merge_heads(attend_heads(split_heads(q, Hq, D), K, V, scale=0.25, mask=mask))
        torch.testing.assert_close(out, exp, rtol=1e-5, atol=1e-6)
    assert cache.layers[0].kp.dtype == torch.uint8


def test_cache_truncate_then_rerun_matches_fresh():
    spec = kq.make_spec(2, 4, 8, 16)
    kw = dict(n_heads=2, n_kv_heads=2, head_dim=16, scale=0.25)
    k, v, q = torch.randn(1, 20, 32), torch.randn(1, 20, 32), torch.randn(1, 20, 32)

    def run(cache, s, t):
        out = cache.attend(0, q[:, s:s + t], k[:, s:s + t], v[:, s:s + t], **kw)
        cache.advance(t)
        return out

    a = kq.QuantizedKVCache(1, 20, torch.float32, "cpu", {0: spec})
    run(a, 0, 18)
    a.truncate(16)  # drops residual tokens only: the state is that of a cache filled to 16
    b = kq.QuantizedKVCache(1, 20, torch.float32, "cpu", {0: spec})
    run(b, 0, 16)
    torch.testing.assert_close(run(a, 16, 4), run(b, 16, 4))
    a.truncate(6)  # cuts into the quantized store: the cut group comes back dequantized
    assert a.length == 6 and a.layers[0].n_q == 4 and a.layers[0].kr.shape[2] == 2


def test_quantized_graph_refuses_a_plain_cache():
    m = _kvq()
    with pytest.raises(LlmaccelError, match="make_cache"):
        m.logits(torch.randint(0, 512, (1, 4)), 0, ContiguousKVCache(1, 4, torch.float32, "cpu"))


# --- the pass ------------------------------------------------------------------------------------

def test_pass_rewrites_every_attention_and_reports_bytes():
    m = _kvq()
    c = m.config
    nodes = [n for n in m.gm.graph.nodes if n.op == "call_function" and n.target is kq.kv_quant_attention]
    assert len(nodes) == c.n_layers and m.op_counts().get("attention", 0) == 0
    assert nodes[0].kwargs["kv_quant"] == {"bits": 4, "group": 4, "residual": 8, "value_group": 4}
    st = m.report["passes"][0]["stats"]
    assert st["bf16_bytes_per_token"] == c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2
    # per kv head: 2 * 16 * 4 / 8 code bytes, K: 2 * 16 * 2 / 4, V: 2 * 4 * 2 -> 48
    assert st["kv_bytes_per_token"] == c.n_layers * c.n_kv_heads * 48
    assert executor.kv_quant_specs(m.gm) == {i: nodes[0].kwargs["kv_quant"] for i in range(c.n_layers)}
    # the spec only acts in the cache: a whole-sequence forward is the source model's
    ids = torch.randint(0, 512, (2, 20))
    torch.testing.assert_close(m.logits(ids), load("preset:tiny-llama").logits(ids))


@pytest.mark.parametrize("opts,match", [
    ({"bits": "3"}, "expected one of 4|2"),
    ({"residual": "100"}, "multiple of kvquant.group"),
    ({"group": "-4"}, "must be positive"),
    ({"group": "6", "residual": "12"}, "layer 0 head_dim 16"),
])
def test_bad_options(opts, match):
    with pytest.raises(LlmaccelError, match=match):
        compile("preset:tiny-llama", ["kvquant"], {"kvquant": opts}, progress=False, eval_tokens=0)


def test_group_default_depends_on_bits():
    from llmaccel.passes.kvquant import KVQuantConfig

    assert KVQuantConfig().group == 32 and KVQuantConfig(bits=2).group == 16
    assert KVQuantConfig(bits=2, group=32).group == 32


def test_residual_longer_than_window_is_exact():
    ids = torch.randint(0, 512, (100,))
    src = load("preset:tiny-llama")
    res = evaluate(_kvq(residual=64), ids, ctx=50, baseline=src, progress=False)
    assert res["chunk"] == 32 and res["kl"] == pytest.approx(0.0, abs=1e-6) and res["top1"] == 1.0


def test_chunked_eval_through_plain_cache_matches_whole_windows():
    m, ids = load("preset:tiny-gpt2"), torch.randint(0, 512, (90,))
    whole = evaluate(m, ids, ctx=40, progress=False)
    chunked = evaluate(m, ids, ctx=40, progress=False, chunk=7)
    assert whole["chunk"] is None and chunked["chunk"] == 7
    assert chunked["ppl"] == pytest.approx(whole["ppl"], rel=1e-5)


def test_quantized_eval_costs_quality_in_order():
    ids = torch.randint(0, 512, (256,))
    src = load("preset:tiny-llama")
    kl = {b: evaluate(_kvq(bits=b), ids, ctx=64, baseline=src, progress=False)["kl"] for b in (4, 2)}
    assert 0 < kl[4] < kl[2]


def test_compile_report_and_artifact_go_through_the_cache(tmp_path):
    m = compile("preset:tiny-llama", ["kvquant"], SMALL, progress=False, eval_tokens=128)
    q = m.report["quality"]
    assert q["chunk"] == 32 and q["kl"] > 0
    m.save(tmp_path / "a", m.report)
    back = load(str(tmp_path / "a"))
    assert executor.kv_quant_specs(back.gm) == executor.kv_quant_specs(m.gm)
    ids = torch.randint(0, 512, (80,))
    assert evaluate(back, ids, ctx=40, progress=False)["ppl"] == pytest.approx(
        evaluate(m, ids, ctx=40, progress=False)["ppl"], rel=1e-6)


def test_generate_decodes_through_the_quantized_cache():
    m = _kvq(residual=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = list(m.generate_ids([1, 5, 9], params))
    assert len(out) == 24
    # greedy decode = argmax of a token-by-token forward through the same cache
    cache = executor.make_cache(m.gm, 1, 27, torch.float32, "cpu")
    assert isinstance(cache, kq.QuantizedKVCache)
    seq, toks = [1, 5, 9], []
    logits = m.logits(torch.tensor([seq]), 0, cache)[:, -1]
    for _ in range(24):
        toks.append(int(logits.argmax()))
        logits = m.logits(torch.tensor([[toks[-1]]]), cache.length, cache)[:, -1]
    assert out == toks


def test_cli_eval_chunk_flag(capsys):
    assert cli.main(["eval", "preset:tiny-llama", "--max-tokens", "64", "--ctx", "32",
                     "--chunk", "8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["chunk"] == 8
    assert cli.main(["eval", "preset:tiny-llama", "--max-tokens", "64", "--ctx", "32",
                     "--chunk", "0"]) == 2


def test_steady_state_bytes_match_the_formula():
    spec = kq.make_spec(2, 8, 16, 32)
    cache = kq.QuantizedKVCache(1, 100, torch.float16, "cpu", {0: spec})
    x = torch.randn(1, 96, 64).half()
    cache.attend(0, x, x, x, n_heads=2, n_kv_heads=2, head_dim=32, scale=0.2)
    st = cache.layers[0]
    residual = st.kr.nbytes + st.vr.nbytes
    assert st.n_q == 80 and cache.nbytes() - residual == 80 * kq.bytes_per_token(spec, 2, 32)
    assert ops.attention is not kq.kv_quant_attention
