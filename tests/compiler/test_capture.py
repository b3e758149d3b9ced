"""Captured tiny presets against transformers: logits and greedy continuations."""
import pytest
import torch

from helpers import hf_for_source, hf_model
from llmaccel import ops
from llmaccel.compiler.hf import config_from_hf, config_to_hf
from llmaccel.compiler.model import load, Model
from llmaccel.compiler.families import capture
from llmaccel.compiler.presets import PRESETS, random_weights
from llmaccel.config import ModelConfig
from llmaccel.sampling import SamplingParams

TINY = ["preset:tiny-llama", "preset:tiny-gpt2"]


@pytest.mark.parametrize("src", TINY)
def test_graph_is_made_of_ir_ops(src):
    m = load(src)
    targets = {n.target for n in m.gm.graph.nodes if n.op == "call_function"}
    assert ops.attention in targets and ops.lm_head in targets and ops.linear in targets
    assert all(t in ops.IR_OPS.values() or t.__module__ == "_operator" for t in targets)
    assert all(n.op != "call_module" for n in m.gm.graph.nodes)


@pytest.mark.parametrize("src", TINY)
def test_logits_match_transformers(src):
    m, hf = load(src), hf_for_source(src)
    ids = torch.randint(0, m.config.vocab_size, (3, 40))
    with torch.no_grad():
        torch.testing.assert_close(m.logits(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("src", TINY)
def test_greedy_64_tokens_match_transformers_generate(src):
    m, hf = load(src), hf_for_source(src)
    g = torch.Generator().manual_seed(7)
    for i in range(8):
        prompt = torch.randint(3, m.config.vocab_size, (1, 4 + 3 * i), generator=g)
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=64, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, prompt.shape[1]:].tolist()
        ours = list(m.generate_ids(prompt[0].tolist(), SamplingParams(max_tokens=64, ignore_eos=True)))
        assert ours == ref, f"prompt {i}"


def test_qwen2_style_qkv_bias_matches_transformers():
    cfg = ModelConfig(family="llama", model_type="qwen2", vocab_size=300, hidden_size=64, n_layers=2,
                      n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=96, norm_eps=1e-6,
                      max_position=256, rope_theta=1e6, attention_bias=True, tie_word_embeddings=True)
    w = random_weights(cfg, std=0.1, seed=3)
    m = Model(capture(cfg, w), cfg, source="test")
    hf = hf_model(cfg, w)
    ids = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(m.logits(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(PRESETS))
def test_hf_config_round_trip(name):
    cfg = PRESETS[name]
    assert config_from_hf(config_to_hf(cfg)).to_dict() == cfg.to_dict()


def test_decode_with_cache_equals_full_forward():
    m = load("preset:tiny-llama")
    from llmaccel.ops.attention import ContiguousKVCache
    ids = torch.randint(0, 512, (2, 12))
    full = m.logits(ids)
    cache = ContiguousKVCache(2, 12, torch.float32, "cpu")
    steps = [m.logits(ids[:, :5], 0, cache)]
    for t in range(5, 12):
        steps.append(m.logits(ids[:, t:t + 1], t, cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


def test_bf16_option_runs_close_to_fp32():
    ids = torch.randint(0, 512, (1, 16))
    a = load("preset:tiny-llama").logits(ids)
    b = load("preset:tiny-llama", dtype="bfloat16").logits(ids)
    assert b.dtype == torch.bfloat16
    assert (a - b.float()).abs().max() < 0.05 * a.abs().max()


def test_verify_checks_the_lowered_graph_too():
    from llmaccel.compiler.pipeline import compile
    m = compile("preset:tiny-llama", ["fuse", "quant"], {"quant": {"method": "rtn"}}, verify=True,
                eval_tokens=0, progress=False)
    low = m.report["lowering"]
    assert low["custom"].get("linear_int4", 0) + low["cpu_traced"].get("linear_int4", 0) > 0
    # the CPU int4 form runs x in bf16 (kernels/int_codes.cpu_act_dtype): a few bf16 roundings
    assert low["rope"] > 0 and low["max_abs_over_max"] < 2e-2
    # the linear forms of the decode steps: rows on a compiled CPU step (on the CPU every linear of
    # this W4 graph is int4 and its LM head takes the bf16 CPU form), fused GEMVs on CUDA
    assert (low["rows"]["linears"] > 0 or low["cpu_traced"].get("lm_head", 0) > 0)
    assert low["rows"]["max_abs_over_max"] < 2e-2
    g = low["gemv"]
    assert g["int4"] > 0 and g["glu"] > 0 and g["residual"] > 0 and g["norm"] > 0
    assert g["max_abs"] < 1e-4
