"""quant.act=int8 (W8A8): SmoothQuant's migration, x rounded to int8 per row, the CPU form and
the artifact. Quality itself is measured on SmolLM2 (docs/quality.md)."""
import pytest
import torch
import torch.nn.functional as F

from llmaccel.codegen.lower import lower
from llmaccel.compiler import executor
from llmaccel.compiler.model import load
from llmaccel.errors import LlmaccelError
from llmaccel.kernels.int_codes import w8a8_mm_cpu
from llmaccel.ops import quant as qo
from llmaccel.passes.quant import QuantConfig
from llmaccel.quant.algorithms import smooth_scale
from tests.passes.test_quant import rel_err, run_passes


def _outlier_x(g, rows=64, k=96):
    x = torch.randn(rows, k, generator=g)
    x[:, :4] *= 60  # a few channels two orders of magnitude larger, as in LLM activations
    return x


def test_smoothing_is_an_exact_reparameterization_and_shrinks_the_rounding_error():
    g = torch.Generator().manual_seed(0)
    x, w = _outlier_x(g), torch.randn(48, 96, generator=g) * 0.05
    x[:, 7] = 0  # a channel never active keeps s = 1
    s = smooth_scale(x, [w[:20], w[20:]], 0.65)
    assert s[7] == 1 and (s[:4] > 5 * s[8:].median()).all()
    torch.testing.assert_close(F.linear(x / s, w * s), F.linear(x, w), rtol=1e-5, atol=1e-5)

    def w8a8(w_eff, smooth):  # int8 rows of the (migrated) weight, x * smooth int8 per row
        sc = w_eff.abs().amax(1) / 127
        return qo.linear_w8a8(x, torch.round(w_eff / sc[:, None]).to(torch.int8), sc, smooth)
    exact = F.linear(x, w)
    assert rel_err(w8a8(w * s, 1 / s), exact) < 0.5 * rel_err(w8a8(w, torch.ones(96)), exact)


@pytest.mark.parametrize("rows", [1, 3, 130])
def test_cpu_form_is_the_reference_up_to_fp32_rounding(rows):
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (40, 96), generator=g, dtype=torch.int8)
    sc, sm, b = torch.rand(40, generator=g) * 0.01, torch.rand(96, generator=g) + 0.5, torch.randn(40, generator=g)
    x = _outlier_x(g, rows).reshape(1, rows, 96)
    want = qo.linear_w8a8(x, q, sc, sm, b)
    got = w8a8_mm_cpu(x, q.t(), sm, sc, b)  # int32 sums: exact; the scalings in another order
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert w8a8_mm_cpu(x.bfloat16(), q.t(), sm, sc).dtype == torch.bfloat16


def test_pass_makes_w8a8_linears_that_load_back_and_lower_on_the_cpu(tmp_path):
    ids = torch.randint(0, 512, (2, 12))
    ref = load("preset:tiny-llama").logits(ids)
    m, st = run_passes("preset:tiny-llama", ["fuse", "quant"], bits=8, act="int8", method="rtn")
    counts = m.op_counts()
    assert counts["linear_w8a8"] == 8 and "linear_int8" not in counts
    assert st["act"] == "int8" and st["smooth"] == 0.65 and "awq_scaled" not in st
    assert rel_err(m.logits(ids), ref) < 0.05
    m.save(tmp_path / "w8a8")
    back = load(str(tmp_path / "w8a8"))
    torch.testing.assert_close(back.logits(ids), m.logits(ids), rtol=0, atol=0)
    low, rep = lower(back.gm, max_len=64)
    assert rep.cpu_traced["linear_w8a8"] == 8
    want = executor.forward(back.gm, ids)
    # the same linears up to fp32 rounding; the head's int8 codes (int8_mm_cpu) differ
    torch.testing.assert_close(executor.forward(low, ids), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_gptq_follows_the_migration():
    _, st = run_passes("preset:tiny-llama", ["fuse", "quant"], bits=8, act="int8", method="awq+gptq")
    assert st["method"] == "awq+gptq" and "awq_scaled" not in st  # smoothing replaced AWQ's scaling


def test_bad_act_options_are_clear_errors():
    with pytest.raises(LlmaccelError, match="quant.act=int8 needs quant.bits=8"):
        QuantConfig(bits=4, act="int8")
    with pytest.raises(LlmaccelError, match="quant.act=fp8: expected none or int8"):
        QuantConfig(bits=8, act="fp8")
    with pytest.raises(LlmaccelError, match=r"quant.smooth=1.5: expected a value in \[0, 1\]"):
        QuantConfig(bits=8, act="int8", smooth=1.5)


def test_llm_generates_from_a_w8a8_artifact_as_the_reference_does(tmp_path):
    """Through the engine on the CPU (eager steps: the CPU forms, the int8 head): greedy tokens
    of a W8A8 artifact; the first tokens agree with the reference executor's."""
    from llmaccel import LLM, SamplingParams

    m, _ = run_passes("preset:tiny-llama", ["fuse", "quant"], bits=8, act="int8", method="rtn")
    m.save(tmp_path / "w8a8")
    llm = LLM(str(tmp_path / "w8a8"), device="cpu", compile=False)
    prompt = [5, 6, 7, 8, 9, 10]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    ref = m.logits(torch.tensor([prompt]))[0, -1].argmax().item()
    assert len(out) == 4 and out[0] == ref
