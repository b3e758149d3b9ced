"""bitlinear: packing, reference ops against explicit formulas, the pass (plain, with heal, with
fuse after it), artifacts, generation. Random tiny models: quality itself is measured on SmolLM2
(llmaccel/passes/bitlinear.py docstring), here the checks are structure and exactness."""
import copy

import pytest
import torch
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.ops import bitlinear as bo
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config
from llmaccel.ir import op_nodes, weight_of
from llmaccel.sampling import SamplingParams

BITLINEAR = get_pass("bitlinear")
PACKED_OPS = (bo.bitlinear, bo.rms_norm_bitlinear)
TRAIN_OPS = (bo.bitlinear_train, bo.rms_norm_bitlinear_train)


def run_pass(src="preset:tiny-llama", trained=False, model=None, **opts):
    m = model or load(src)
    ctx = PassContext(m.config, progress=Progress(False), trained=trained)
    res = BITLINEAR(make_config(BITLINEAR, {k: str(v) for k, v in opts.items()})).run(m.gm, ctx)
    res.gm.graph.lint()
    res.gm.recompile()
    m.gm = res.gm
    return m, res.stats


def ternary_weights(N, K):
    t, s = bo.ternarize(torch.randn(N, K), "per_channel")
    return t, s, bo.pack_ternary(t)


# --- packing and reference ops ---------------------------------------------------------------------

@pytest.mark.parametrize("K", [64, 100, 576])
def test_pack_roundtrip_and_layout(K):
    t = torch.randint(-1, 2, (5, K))
    p = bo.pack_ternary(t)
    assert p.dtype == torch.uint8 and p.shape == (5, bo.padded_in(K) // 4)
    assert torch.equal(bo.unpack_ternary(p, K), t.to(torch.int8))
    # byte j of a 64-column block: columns j, j + 16, j + 32, j + 48 in bits 0-1, 2-3, 4-5, 6-7
    one = torch.zeros(1, 64, dtype=torch.long)
    one[0, 3], one[0, 19], one[0, 35], one[0, 51] = 1, -1, 1, 0
    b = bo.pack_ternary(one)[0]
    assert b[3].item() == 2 | (0 << 2) | (2 << 4) | (1 << 6) and b[0].item() == 0x55
    if K % 64:  # padding columns hold the code of 0
        assert (bo.unpack_ternary(p, bo.padded_in(K))[:, K:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitlinear_matches_explicit_formula(dtype):
    N, K = 24, 100
    t, s, p = ternary_weights(N, K)
    x, b = torch.randn(2, 3, K).to(dtype), torch.randn(N).to(dtype)
    xf = x.float()
    scale = 127 / xf.abs().amax(-1, keepdim=True)
    x_q = torch.clamp(torch.round(xf * scale), -128, 127) / scale      # fake-quantized activations
    want = (x_q @ (t * s[:, None]).T + b.float()).to(dtype)
    got = bo.bitlinear(x, p, s.to(dtype), b, in_features=K, out_features=N)
    assert got.dtype == dtype and got.shape == (2, 3, N)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


def test_activation_codes_are_int8_and_accumulation_exact():
    K = 4096
    h = torch.randn(3, K) * torch.logspace(-3, 3, K)                   # wide dynamic range
    q, inv = bo.act_quant(h)
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    assert torch.equal(q.abs().amax(-1), torch.full((3,), 127.0))
    t = torch.randint(-1, 2, (8, K)).float()
    assert torch.equal((q @ t.T).long(), q.long() @ t.long().T)         # fp32 sum of ints: exact


def test_fused_op_is_rms_norm_then_bitlinear():
    N, K = 16, 128
    t, s, p = ternary_weights(N, K)
    x, g = torch.randn(4, K) * 3, torch.rand(K) + 0.5
    fused = bo.rms_norm_bitlinear(x, g, p, s, None, eps=1e-6, in_features=K, out_features=N)
    two = bo.bitlinear(ops.rms_norm(x, g, eps=1e-6), p, s, None, in_features=K, out_features=N)
    assert torch.equal(fused, two)


def test_ternarize_scales():
    w = torch.randn(6, 32)
    w[:3] *= 10                                                        # two "linears" of one group
    t, s = bo.ternarize(w, "per_tensor", (3, 3))
    assert set(t.unique().tolist()) <= {-1.0, 0.0, 1.0}
    torch.testing.assert_close(s, torch.cat([w[:3].abs().mean().expand(3), w[3:].abs().mean().expand(3)]))
    _, sc = bo.ternarize(w, "per_channel")
    torch.testing.assert_close(sc, w.abs().mean(1))


def test_training_op_forward_and_straight_through_gradients():
    N, K = 12, 64
    w = torch.randn(N, K, requires_grad=True)
    x = torch.randn(5, K, requires_grad=True)
    lam = torch.ones(())
    y = bo.bitlinear_train(x, w, None, lam, scale="per_tensor", segments=(N,))
    t, s = bo.ternarize(w.detach(), "per_tensor")
    want = bo.bitlinear(x.detach(), bo.pack_ternary(t), s, None, in_features=K, out_features=N)
    torch.testing.assert_close(y.detach(), want, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    y0 = bo.bitlinear_train(x, w, None, torch.zeros(()), scale="per_tensor", segments=(N,))
    torch.testing.assert_close(y0, F.linear(x, w))                     # lam = 0: unquantized


# --- the pass --------------------------------------------------------------------------------------

def test_pass_structure_and_stats():
    m, st = run_pass()
    counts = m.op_counts()
    assert counts.get("linear", 0) == 0 and counts["lm_head"] == 1 and counts["embedding"] == 1
    # per layer: one fused op for q,k,v and one for gate,up; plain ops for o and down
    assert counts["rms_norm_bitlinear"] == 4 and counts["bitlinear"] == 4 and counts["rms_norm"] == 1
    assert st["linears_converted"] == 14 and st["norms_fused"] == 4 and st["form"] == "packed"
    assert st["weight_bytes_after"] < st["weight_bytes_before"] / 8
    assert not any(p.requires_grad for p in m.gm.parameters()) and not list(m.gm.buffers())
    names = {n.target for n in m.gm.graph.nodes if n.op == "get_attr"}
    assert "layers.0.qkv.w_packed" in names and "layers.1.down.w_scale" in names
    assert not any(n.endswith((".latent", "q.weight")) for n in names)


def test_pass_equals_reference_composition():
    """The converted graph computes what the per-linear reference formulas say."""
    src = load("preset:tiny-llama")
    m, _ = run_pass(scale="per_channel")
    lin = {n.args[1].target: n for n in op_nodes(src.gm, ops.linear)}
    node = next(n for n in op_nodes(m.gm, bo.rms_norm_bitlinear))     # layer 0 q,k,v
    x = torch.randn(3, 64)
    g = weight_of(src.gm, next(n for n in op_nodes(src.gm, ops.rms_norm)).args[1])
    h = ops.rms_norm(x, g, eps=src.config.norm_eps)
    want = []
    for name in ("layers.0.q.weight", "layers.0.k.weight", "layers.0.v.weight"):
        t, s = bo.ternarize(weight_of(src.gm, lin[name].args[1]), "per_channel")
        want.append(bo.bitlinear(h, bo.pack_ternary(t), s, None, in_features=64, out_features=t.shape[0]))
    got = bo.rms_norm_bitlinear(x, weight_of(m.gm, node.args[1]), weight_of(m.gm, node.args[2]),
                                weight_of(m.gm, node.args[3]), None, **node.kwargs)
    assert torch.equal(got, torch.cat(want, -1))


def test_compile_with_heal_leaves_packed_weights():
    m = compile("preset:tiny-llama", ["bitlinear", "heal"],
                {"heal": {"steps": 3, "seq_len": 16, "batch": 1, "eval_windows": 2}},
                calib="self", eval_tokens=0, progress=False)
    assert not op_nodes(m.gm, *TRAIN_OPS) and len(op_nodes(m.gm, *PACKED_OPS)) == 8
    assert any(p.dtype == torch.uint8 for p in m.gm.parameters()) and not list(m.gm.buffers())
    st = m.report["passes"][0]["stats"]
    assert st["form"].startswith("training")
    heal = m.report["passes"][1]["stats"]
    assert heal["bitlinear"]["weight_bytes_after"] > 0 and len(heal["loss_curve"]) == 3
    assert heal["params_trained"] > 0
    assert m.logits(torch.randint(0, 512, (1, 6))).isfinite().all()


def test_heal_finish_equals_non_heal_pass():
    ids = torch.randint(0, 512, (2, 11))
    plain, _ = run_pass()
    trained, _ = run_pass(trained=True)
    assert len(op_nodes(trained.gm, *TRAIN_OPS)) == 8
    train_logits = trained.logits(ids)
    st = BITLINEAR.training_form(trained.gm).finish()
    trained.gm.recompile()
    assert st["bitlinear"]["bits_per_weight"] < 3 and BITLINEAR.training_form(trained.gm).finish() == {}
    out = trained.logits(ids)
    assert torch.equal(out, plain.logits(ids))
    # the training form's forward is the inference form up to fp32 rounding, which can move an
    # activation that sits on an int8 rounding boundary by one code: that token's logits then
    # differ by ~0.5% (measured: one position of 22 at the suite's seed), the others do not
    per_pos = (train_logits - out).abs().amax(-1) / out.abs().max()
    assert (per_pos <= 1e-5).float().mean() >= 0.9 and per_pos.max() <= 1e-2, per_pos


def test_warmup_schedule_ramps_quantization():
    m, _ = run_pass(trained=True, warmup=0.5)
    ids = torch.randint(0, 512, (1, 9))
    BITLINEAR.training_form(m.gm).schedule(0.0)
    assert m.gm.bitlinear_lambda.item() == 0.0
    torch.testing.assert_close(m.logits(ids), load("preset:tiny-llama").logits(ids), rtol=1e-4, atol=1e-4)
    BITLINEAR.training_form(m.gm).schedule(0.25)
    assert m.gm.bitlinear_lambda.item() == 0.5
    BITLINEAR.training_form(m.gm).schedule(0.9)
    assert m.gm.bitlinear_lambda.item() == 1.0


def test_artifact_roundtrip_identical_logits(tmp_path):
    from safetensors import safe_open

    m, _ = run_pass()
    ids = torch.randint(0, 512, (1, 12))
    m.save(tmp_path / "art")
    back = load(str(tmp_path / "art"))
    assert torch.equal(back.logits(ids), m.logits(ids))
    with safe_open(str(tmp_path / "art" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert any(k.endswith(".w_packed") and f.get_tensor(k).dtype == torch.uint8 for k in keys)
        assert not any(k.endswith((".latent", "q.weight", "down.weight")) for k in keys)


def test_generation_through_executor_matches_full_forward():
    m, _ = run_pass()
    prompt = torch.randint(3, 512, (7,)).tolist()
    got = list(m.generate_ids(prompt, SamplingParams(max_tokens=6, ignore_eos=True)))
    ids = list(prompt)
    for _ in range(6):  # no cache: the whole sequence each step
        ids.append(int(m.logits(torch.tensor([ids]))[0, -1].argmax()))
    assert got == ids[len(prompt):]


def test_gpt2_plain_bitlinear_and_fuse_after():
    m, st = run_pass("preset:tiny-gpt2")
    assert st["norms_fused"] == 0 and m.op_counts()["layer_norm"] >= 4
    assert not op_nodes(m.gm, ops.linear)
    ids = torch.randint(0, 512, (1, 8))
    before = m.logits(ids)
    fuse = get_pass("fuse")
    res = fuse().run(m.gm, PassContext(m.config, progress=Progress(False)))
    res.gm.recompile()
    m.gm = res.gm
    torch.testing.assert_close(m.logits(ids), before, rtol=1e-5, atol=1e-5)


def test_options_subset_and_errors():
    m, st = run_pass(linears="gate,up,down", scale="per_channel")
    assert st["linears_converted"] == 6 and st["norms_fused"] == 2
    assert len(op_nodes(m.gm, ops.linear)) == 8 and st["scale"] == "per_channel"
    with pytest.raises(LlmaccelError, match="bitlinear.scale=per_row"):
        make_config(BITLINEAR, {"scale": "per_row"})
    with pytest.raises(LlmaccelError, match="bitlinear.linears=qq"):
        make_config(BITLINEAR, {"linears": "qq"})
    with pytest.raises(LlmaccelError, match="run bitlinear before fuse"):
        m = load("preset:tiny-llama")
        res = get_pass("fuse")().run(m.gm, PassContext(m.config, progress=Progress(False)))
        m.gm = res.gm
        run_pass(model=m)
    with pytest.raises(LlmaccelError, match="already holds BitLinear"):
        run_pass(model=copy.deepcopy(run_pass()[0]))


def test_heal_trains_through_the_straight_through_estimator():
    m = compile("preset:tiny-llama", ["bitlinear", "heal"],
                {"heal": {"steps": 6, "seq_len": 16, "batch": 4, "eval_windows": 4, "lr": 3e-3}},
                calib="self", eval_tokens=0, progress=False)
    st = m.report["passes"][1]["stats"]
    assert st["kl_after"] < 0.9 * st["kl_before"]
    assert st["delta_ppl_pct_after"] < st["delta_ppl_pct_before"]
