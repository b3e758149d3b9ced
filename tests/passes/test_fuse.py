"""fuse is exact: logits before and after agree to fp32 rounding, on fresh random inputs."""
import pytest
import torch

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.ops.attention import ContiguousKVCache


@pytest.mark.parametrize("src", ["preset:tiny-llama", "preset:tiny-gpt2"])
def test_fuse_is_exact_and_rewrites(src):
    ids = torch.randint(0, 512, (2, 33))
    ref = load(src).logits(ids)
    m = compile(src, ["fuse"], verify=True, progress=False)
    out = m.logits(ids)
    # fp32 rounding: folded scales change the order of a few multiplies
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    st = m.report["passes"][0]["stats"]
    L = m.config.n_layers
    assert st["add_norm_fused"] == 2 * L + (1 if src.endswith("gpt2") else 0)
    assert st["linears_fused"] == (2 * L if src.endswith("llama") else L)
    assert m.report["passes"][0]["verify"]["max_abs_over_max"] < 1e-5
    counts = m.op_counts()
    assert counts.get("layer_norm", 0) + counts.get("rms_norm", 0) <= 1
    # no norm in the graph still carries a scale, except one feeding a tied LM head
    for n in m.gm.graph.nodes:
        if n.op == "call_function" and n.target in (ops.add_rms_norm, ops.rms_norm):
            assert n.args[-1] is None or m.config.tie_word_embeddings or any(
                u.target is ops.lm_head for u in n.users)


def test_fuse_keeps_tied_embedding_shared():
    m = compile("preset:tiny-gpt2", ["fuse"], progress=False)
    names = {n.target for n in m.gm.graph.nodes if n.op == "get_attr"}
    assert "embed.weight" in names and not any(x.startswith("embed.weight_") for x in names)


def test_fused_graph_decodes_like_unfused():
    ids = torch.randint(0, 512, (1, 10))
    m = compile("preset:tiny-llama", ["fuse"], progress=False)
    cache = ContiguousKVCache(1, 10, torch.float32, "cpu")
    steps = [m.logits(ids[:, :4], 0, cache)] + [m.logits(ids[:, t:t + 1], t, cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), load("preset:tiny-llama").logits(ids), rtol=1e-4, atol=1e-4)


def test_fuse_options_switch_rewrites_off():
    m = compile("preset:tiny-llama", ["fuse"], {"fuse": {"linears": "false", "add_norm": "0"}}, progress=False)
    st = m.report["passes"][0]["stats"]
    assert "linears_fused" not in st and "add_norm_fused" not in st and st["norms_folded"] > 0
    assert m.op_counts()["linear"] == 14
