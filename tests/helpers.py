"""Test helpers: hand canonical weights to transformers to compare against it directly."""
import torch
import transformers

from llmaccel.compiler.hf import config_to_hf, weights_to_hf
from llmaccel.compiler.sources import resolve


def hf_model(cfg, weights):
    hfc = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    m = transformers.AutoModelForCausalLM.from_config(hfc, dtype=torch.float32).eval()
    res = m.load_state_dict(weights_to_hf(weights, cfg), strict=False)
    assert not res.missing_keys, res.missing_keys
    return m


def hf_for_source(src):
    s = resolve(src)
    return hf_model(s.config, s.weights)
