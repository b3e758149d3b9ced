"""The runtime on the real SmolLM2-135M (fp32, CPU): greedy output identical to the reference
executor's, whose greedy output is identical to HF generate (tests/test_real_smollm2.py).

Generating the reference greedily one token at a time would dominate this module's time, so the
batched runtime's output is checked by teacher forcing instead: one executor forward over prompt +
output per prompt, every output token must be the argmax there (which makes it the greedy
sequence). Every other configuration must then reproduce it token for token.
"""
import pytest
import torch

from llmaccel import LLM, SamplingParams, cli, load

pytestmark = pytest.mark.real
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of",
           "In 1969, the first humans", "To make a cup of tea, you",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load("smollm2-135m")


@pytest.fixture(scope="module")
def batched(model):
    llm = LLM(model)
    outs = llm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        ids = model.encode(p)
        logits = model.logits(torch.tensor([ids + o.token_ids]))[0, len(ids) - 1: -1]
        assert logits.argmax(-1).tolist() == o.token_ids, p
    return llm, outs


def test_batched_text_stream_and_stop(model, batched):
    llm, outs = batched
    assert outs[0].text == model.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)
    pieces = list(llm.stream(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True)))
    assert len(pieces) > 1 and outs[0].text.startswith("".join(pieces))
    cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=32, stop=["."]))[0]
    assert cut.finish_reason == "stop" and "." not in cut.text and outs[0].text.startswith(cut.text)


@pytest.mark.parametrize("kw", [{"kv_cache_tokens": 160, "block_size": 16},
                                {"speculative": "self"}, {"speculative": "ngram"}],
                         ids=["preempt", "self", "ngram"])
def test_greedy_identical_to_batched_reference(model, batched, kw):
    llm = LLM(model, **kw)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in batched[1]]
    m = llm.metrics()
    if "kv_cache_tokens" in kw:
        assert m["preemptions"] > 0
    else:
        assert m["spec_accepted"] > 0 and m["spec_tokens_per_step"] > 1


def test_cli_generate_speculative(capsys):
    assert cli.main(["generate", "smollm2-135m", "--prompt", "The capital of France is",
                     "--temperature", "0", "--max-new-tokens", "8", "--speculative", "ngram"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_stream_never_shows_text_a_stop_string_cuts(batched):
    """Stop strings taken from the text, some spanning two decode groups: the streamed pieces
    join to exactly what generate returns (the stream holds back a possible stop's start)."""
    llm, _ = batched
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=24))[0].text
    for i in range(len(full) // 2 + 1, len(full) - 6, 4):
        p = SamplingParams(max_tokens=24, stop=[full[i:i + 6]])
        assert "".join(llm.stream(PROMPTS[0], p)) == llm.generate(PROMPTS[0], p)[0].text
