"""LLM arguments and SamplingParams: a bad value is one LlmaccelError (a ValueError) that names it."""
import pytest

from llmaccel import LLM, SamplingParams
from llmaccel.errors import LlmaccelError


@pytest.mark.parametrize("kw, match", [
    ({"kv_cache_tokens": "x"}, "kv_cache_tokens must be a positive integer, got 'x'"),
    ({"kv_cache_tokens": 0}, "kv_cache_tokens must be a positive integer, got 0"),
    ({"max_num_seqs": 1.5}, "max_num_seqs must be a positive integer, got 1.5"),
    ({"block_size": 0}, "block_size must be a positive integer"),
    ({"num_speculative_tokens": 0, "speculative": "ngram"}, "num_speculative_tokens must be a positive integer"),
])
def test_llm_arguments(tiny, kw, match):
    with pytest.raises(LlmaccelError, match=match):
        LLM(tiny, **kw)


def test_nan_temperature_refused_and_errors_are_value_errors():
    with pytest.raises(ValueError, match="temperature must be >= 0, got nan"):
        SamplingParams(temperature=float("nan"))
    assert issubclass(LlmaccelError, ValueError)
