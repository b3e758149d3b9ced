"""Test helpers: hand canonical weights to transformers to compare against it directly; check a
model's greedy decode against its whole-sequence forward."""
import torch
import transformers

from llmaccel.compiler.hf import config_to_hf, weights_to_hf
from llmaccel.compiler.sources import resolve
from llmaccel.sampling import SamplingParams


def hf_model(cfg, weights):
    hfc = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    m = transformers.AutoModelForCausalLM.from_config(hfc, dtype=torch.float32).eval()
    res = m.load_state_dict(weights_to_hf(weights, cfg), strict=False)
    assert not res.missing_keys, res.missing_keys
    return m


def hf_for_source(src):
    s = resolve(src)
    return hf_model(s.config, s.weights)


def assert_greedy_matches_logits(m, prompt: list[int], n: int) -> None:
    """Greedy generation through the model's decode context = the argmax of whole-sequence
    forwards, token by token (a recurrent state or a cache that drifts shows here)."""
    out = list(m.generate_ids(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(m.logits(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt):]
