"""gqa: KV heads merge; the PCA merge is exact when the merged heads are redundant (keys equal
up to a per-frequency complex scale, which commutes with RoPE; values equal up to a linear map),
the cluster merge finds which heads are alike; KV bytes and the config follow the graph."""
import pytest
import torch

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.ops.attention import ContiguousKVCache
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config
from llmaccel.passes.gqa import _cmul_rows
from llmaccel.ir import op_nodes, weight_of

CALIB = {"calib_samples": "4", "calib_seq_len": "32"}


def _run(model, **opts):
    g = torch.Generator().manual_seed(0)
    ctx = PassContext(model.config, progress=Progress(False),
                      calib_source=lambda n, s: torch.randint(0, 512, (n, s), generator=g))
    cls = get_pass("gqa")
    res = cls(make_config(cls, {**CALIB, **{k: str(v) for k, v in opts.items()}})).run(model.gm, ctx)
    res.gm.recompile()
    return res


def _redundant_kv(model, rope: bool):
    """Make every KV head a transform of head 0: keys a per-frequency complex scale (RoPE) or an
    invertible map (no RoPE), values an invertible map; biases to match."""
    hd = model.config.head_dim
    for att in op_nodes(model.gm, ops.attention):
        k_lin = att.args[1].args[0] if rope else att.args[1]
        for lin, is_k in ((k_lin, True), (att.args[2], False)):
            w = weight_of(model.gm, lin.args[1])
            b = weight_of(model.gm, lin.args[2]) if len(lin.args) > 2 else None
            for j in range(1, w.shape[0] // hd):
                if is_k and rope:
                    c = torch.polar(0.5 + torch.rand(hd // 2, dtype=torch.float64),
                                    6.3 * torch.rand(hd // 2, dtype=torch.float64))
                    f = lambda t: _cmul_rows(t.double(), c, hd).float()  # noqa: E731
                else:
                    A = torch.eye(hd) + 0.3 * torch.randn(hd, hd)
                    f = lambda t, A=A: A @ t  # noqa: E731
                w[j * hd:(j + 1) * hd] = f(w[:hd])
                if b is not None:
                    b[j * hd:(j + 1) * hd] = f(b[:hd])


@pytest.mark.parametrize("src", ["preset:tiny-llama", "preset:tiny-gpt2"])
def test_pca_merge_is_exact_for_redundant_heads(src):
    m = load(src)
    _redundant_kv(m, rope=src.endswith("llama"))
    ids = torch.randint(0, 512, (2, 24))
    ref = m.logits(ids)
    st = _run(m, kv_heads=1, method="pca").stats
    assert st["kv_heads_after"] == 1 and m.config.n_kv_heads == 1
    assert st["kv_bytes_per_token_after"] * st["kv_heads_before"] == st["kv_bytes_per_token_before"]
    out = m.logits(ids)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
    assert all(n.kwargs["n_kv_heads"] == 1 for n in op_nodes(m.gm, ops.attention))


def test_mean_merge_is_the_mean_and_decode_matches_prefill():
    m = load("preset:tiny-llama")
    att = op_nodes(m.gm, ops.attention)[0]
    wk = weight_of(m.gm, att.args[1].args[0].args[1]).clone()
    st = _run(m, kv_heads=1, method="mean").stats
    assert st["kv_bytes_per_token_before"] == 2 * st["kv_bytes_per_token_after"] == 2 * 2 * 2 * 16 * 4
    new = weight_of(m.gm, att.args[1].args[0].args[1])
    torch.testing.assert_close(new, (wk[:16] + wk[16:]) / 2)
    ids = torch.randint(0, 512, (1, 9))
    cache = ContiguousKVCache(1, 9, torch.float32, "cpu")
    steps = [m.logits(ids[:, :5], 0, cache)] + [m.logits(ids[:, t:t + 1], t, cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), m.logits(ids), rtol=1e-4, atol=1e-4)
    assert cache.k[0].shape[1] == 1  # one KV head cached


def test_cluster_groups_alike_heads():
    # tiny-gpt2 has 4 KV heads; make heads 0 and 2 identical and heads 1 and 3 identical
    m = load("preset:tiny-gpt2")
    for att in op_nodes(m.gm, ops.attention):
        for lin in att.args[1:3]:
            w = weight_of(m.gm, lin.args[1])
            b = weight_of(m.gm, lin.args[2])
            w[32:48], w[48:64], b[32:48], b[48:64] = w[0:16], w[16:32], b[0:16], b[16:32]
    ids = torch.randint(0, 512, (2, 20))
    ref = m.logits(ids)
    mean = load("preset:tiny-gpt2")
    mean.gm.load_state_dict(m.gm.state_dict())
    _run(m, kv_heads=2, method="cluster")
    torch.testing.assert_close(m.logits(ids), ref, rtol=1e-4, atol=1e-4)  # (0,2), (1,3): exact
    _run(mean, kv_heads=2, method="mean")  # (0,1), (2,3): not
    assert (mean.logits(ids) - ref).abs().max() > 1e-2


def test_gqa_errors_and_noop():
    m = load("preset:tiny-llama")
    with pytest.raises(LlmaccelError, match="must divide"):
        _run(m, kv_heads=3)
    assert _run(m, kv_heads=2).changed == 0
    with pytest.raises(LlmaccelError, match="before quant"):
        compile("preset:tiny-llama", ["quant", "gqa"], {"gqa": CALIB, "quant": {"bits": "8"}},
                progress=False, eval_tokens=0)
    with pytest.raises(LlmaccelError, match="gqa.kv_heads"):
        make_config(get_pass("gqa"), {"kv_heads": "0"})


def test_gqa_then_fuse_artifact_roundtrip(tmp_path):
    m = compile("preset:tiny-llama", ["gqa", "fuse"], {"gqa": {**CALIB, "kv_heads": "1"}},
                progress=False, eval_tokens=0)
    m.save(tmp_path / "a", m.report)
    back = load(str(tmp_path / "a"))
    assert back.config.n_kv_heads == 1
    ids = torch.randint(0, 512, (1, 12))
    torch.testing.assert_close(back.logits(ids), m.logits(ids))


@pytest.mark.parametrize("src", ["preset:tiny-llama", "preset:tiny-gpt2"])
def test_gqa_after_fuse_equals_gqa_before_fuse(src):
    """On a fused graph gqa splits q/k/v, merges and fuses again: the same model as gqa,fuse."""
    opts = {"gqa": {"kv_heads": "1", "method": "mean"}}
    a = compile(src, ["gqa", "fuse"], opts, progress=False, eval_tokens=0)
    b = compile(src, ["fuse", "gqa"], opts, progress=False, eval_tokens=0)
    assert b.report["passes"][1]["stats"]["fused_groups_split_and_refused"] > 0
    assert b.op_counts() == a.op_counts()
    ids = torch.randint(0, b.config.vocab_size, (2, 12))
    torch.testing.assert_close(b.logits(ids), a.logits(ids), rtol=1e-4, atol=1e-4)
