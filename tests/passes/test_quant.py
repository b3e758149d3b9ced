"""quant: packing, reference ops, options, every method in graphs with and without `fuse`,
artifacts that load back packed. Random tiny models: quality itself is measured on SmolLM2
(docs/quality.md); here the checks are structure, exactness of the rewrites and error bounds."""
import pytest
import torch

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.errors import LlmaccelError
from llmaccel.ops import quant as qo
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config
from llmaccel.passes.quant import Grid, QuantConfig, gptq

QUANT = get_pass("quant")


def _calib(n, seq_len):
    return torch.randint(0, 512, (n, seq_len), generator=torch.Generator().manual_seed(1))


def run_passes(src, names, **opts):
    """Load src and run passes directly (calibration: fixed random ids, no sampling)."""
    m = load(src)
    ctx = PassContext(m.config, progress=Progress(False), calib_source=_calib)
    q_opts = {"n_samples": 4, "seq_len": 32, "awq_tokens": 128, "group_size": 32, **opts}
    stats = None
    for name in names:
        cls = get_pass(name)
        res = cls(make_config(cls, q_opts if name == "quant" else {})).run(m.gm, ctx)
        res.gm.graph.lint()
        res.gm.recompile()
        m.gm = res.gm
        if name == "quant":
            stats = res.stats
    return m, stats


def rel_err(out, ref):
    return ((out - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()


def test_pack_roundtrip_and_low_nibble_first():
    q = torch.randint(0, 16, (3, 5, 8))
    p = qo.pack_int4(q)
    assert p.dtype == torch.uint8 and p.shape == (3, 5, 4)
    assert torch.equal(qo.unpack_int4(p), q.to(torch.uint8))
    assert qo.pack_int4(torch.tensor([1, 2])).item() == 0x21
    assert torch.equal(qo.unpack_int4(qo.pack_zeros(torch.tensor([[3, 4, 5]])))[:, :3], torch.tensor([[3, 4, 5]], dtype=torch.uint8))


def test_reference_ops_match_manual_dequantization():
    N, K, gs = 6, 80, 32                       # K is not a multiple of gs: last group padded
    G = -(-K // gs)
    q = torch.randint(0, 16, (N, G * gs))
    s, z = torch.rand(N, G) + 0.1, torch.randint(0, 16, (N, G))
    w = ((q.float() - z.repeat_interleave(gs, 1)) * s.repeat_interleave(gs, 1))[:, :K]
    x, b = torch.randn(2, 3, K), torch.randn(N)
    out = qo.linear_int4(x, qo.pack_int4(q.reshape(N, G, gs)), s, qo.pack_zeros(z), b, group_size=gs)
    torch.testing.assert_close(out, x @ w.T + b, rtol=1e-5, atol=1e-5)
    q8, s8 = torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N)
    torch.testing.assert_close(qo.linear_int8(x, q8, s8), x @ (q8.float() * s8[:, None]).T, rtol=1e-5, atol=1e-5)


def test_bad_options_are_clear_errors():
    with pytest.raises(LlmaccelError, match="quant.bits=3: expected one of 8|4"):
        make_config(QUANT, {"bits": "3"})
    with pytest.raises(LlmaccelError, match="quant.group_size=48"):
        make_config(QUANT, {"group_size": "48"})
    with pytest.raises(LlmaccelError, match="supported bits are 8 and 4"):
        QuantConfig(bits=2)
    with pytest.raises(LlmaccelError, match="supported sizes are 32, 64, 128"):
        QuantConfig(group_size=16)
    with pytest.raises(LlmaccelError, match="expected one of rtn.awq.gptq"):
        make_config(QUANT, {"method": "magic"})
    with pytest.raises(LlmaccelError, match="n_samples"):
        make_config(QUANT, {"n_samples": "0"})


def test_gptq_beats_rtn_on_its_own_objective():
    torch.manual_seed(0)
    X = torch.randn(512, 96) @ torch.randn(96, 96)        # correlated inputs
    W = torch.randn(40, 96)
    grid = Grid(4, 32)
    H = X.T @ X
    for act_order in (False, True):
        q, s, z = gptq(W, H, grid, act_order=act_order, damp=0.01)
        assert q.min() >= 0 and q.max() <= 15 and q.shape == (40, 96)
        wq = grid.dequant(q, s, z, 96)
        assert (X @ (W - wq).T).norm() < 0.8 * (X @ (W - grid.rtn(W)).T).norm()


@pytest.mark.parametrize("method,order", [
    ("rtn", ["quant"]), ("awq", ["quant"]), ("awq", ["fuse", "quant"]), ("gptq", ["quant", "fuse"]),
    ("awq+gptq", ["fuse", "quant"]), ("awq+gptq", ["quant", "fuse"])])
def test_methods_in_any_order_with_fuse(method, order):
    ids = torch.randint(0, 512, (2, 17))
    ref = load("preset:tiny-llama").logits(ids)
    m, st = run_passes("preset:tiny-llama", order, method=method, bits=4)
    counts = m.op_counts()
    assert counts.get("linear", 0) == 0 and counts["linear_int4"] == (14 if order[0] == "quant" else 8)
    assert counts["lm_head"] == 1                              # kept in the source dtype by default
    assert rel_err(m.logits(ids), ref) < 0.5                   # 4-bit, g32, random weights
    assert st["group_size"] == 32 and st["bytes_per_weight"] < 0.7
    if "awq" in method:
        # o after GQA attention is scaled too (one scale per v channel, folded into v's rows)
        assert st["awq_scaled"] > 0 and st["awq_skipped"] == {}
        # after fuse the norms had no weight; AWQ gives them one holding 1/s
        norms = [n for n in m.gm.graph.nodes if n.op == "call_function" and n.target in (ops.rms_norm, ops.add_rms_norm)]
        assert sum(n.args[-1] is not None for n in norms) >= 2


def test_int8_is_close_and_per_channel():
    ids = torch.randint(0, 512, (1, 20))
    ref = load("preset:tiny-llama").logits(ids)
    m, st = run_passes("preset:tiny-llama", ["fuse", "quant"], bits=8, method="rtn")
    assert rel_err(m.logits(ids), ref) < 0.05
    n = next(n for n in m.gm.graph.nodes if n.op == "call_function" and n.target is qo.linear_int8)
    assert n.args[1].target.endswith("qweight") and m.gm.get_parameter(n.args[1].target).dtype == torch.int8
    assert "group_size" not in st


def test_awq_folds_into_previous_linear_for_mha():
    # GPT-2 is MHA: o's scale folds into v's rows (fused qkv after `fuse`); fc -> gelu -> proj cannot.
    ids = torch.randint(0, 512, (1, 20))
    ref = load("preset:tiny-gpt2").logits(ids)
    for order in (["quant"], ["fuse", "quant"]):
        m, st = run_passes("preset:tiny-gpt2", order, method="awq", bits=8)
        assert "o after GQA attention" not in st["awq_skipped"]
        assert st["awq_skipped"] == {"input is gelu": 2}
        assert rel_err(m.logits(ids), ref) < 0.05


def test_lm_head_option_and_padding_stats():
    m, st = run_passes("preset:tiny-llama", ["quant"], method="rtn", lm_head=True, group_size=128)
    assert m.op_counts().get("lm_head", 0) == 0 and m.op_counts()["linear_int4"] == 15
    assert "embed.weight" in {n.target for n in m.gm.graph.nodes if n.op == "get_attr"}
    assert st["padded_in_features"] == [64]                    # tiny-llama K = 64 < 128


def test_artifact_holds_packed_weights_and_loads_back(tmp_path):
    from safetensors import safe_open

    ids = torch.randint(0, 512, (1, 12))
    m, _ = run_passes("preset:tiny-llama", ["fuse", "quant"], method="gptq", bits=4)
    m.save(tmp_path / "art")
    back = load(str(tmp_path / "art"))
    torch.testing.assert_close(back.logits(ids), m.logits(ids), rtol=0, atol=0)
    with safe_open(str(tmp_path / "art" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert any(k.endswith(".qweight") and f.get_tensor(k).dtype == torch.uint8 for k in keys)
        assert not any(k.endswith(("qkv.weight", "down.weight")) for k in keys)


def test_bf16_calibration_products_on_bf16_cpus(monkeypatch):
    """Where the CPU multiplies bf16 in hardware, the calibration's Hessian and linear outputs run
    in bf16 with fp32 sums: the Hessian within 0.5% of sqrt(H_ii H_jj) of float64's (fp32 inputs
    rounded to bf16 once, each 1,024-token chunk's sum rounded once), the outputs within bf16
    rounding; with LLMACCEL_CPU_BF16=0 (the tests' default) both are the plain fp32 products."""
    from llmaccel.passes import quant as qp
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5000, 96, generator=g) * torch.rand(96, generator=g).pow(3).mul(8).add(0.1)
    w, b = torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    assert torch.equal(qp._gram(x), x.T @ x)
    assert torch.equal(qp._linear(x, w, b), torch.nn.functional.linear(x, w, b))
    monkeypatch.setattr(qp, "cpu_bf16_dots", lambda: True)
    H, Hd = qp._gram(x), x.double().T @ x.double()
    d = Hd.diagonal().sqrt()
    assert H.dtype == torch.float32 and ((H.double() - Hd).abs() / (d[:, None] * d[None])).max() < 5e-3
    y, ref = qp._linear(x, w, b), torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert y.dtype == torch.float32 and rel_err(y.double(), ref) < 1e-2
    assert not qp._bf16_products(x.bfloat16())                 # a bf16 model's own products
