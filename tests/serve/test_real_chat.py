"""The real SmolLM2-135M-Instruct behind the server answers chat requests sensibly (CPU)."""
import openai
import pytest

from llmaccel import LLM
from tests.serve.conftest import serve_thread

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def client():
    try:
        llm = LLM("smollm2-135m", max_num_seqs=4)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"smollm2-135m unavailable: {e}")
    with serve_thread(llm, name="smollm2-135m") as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_chat_answers_and_streams_the_same_text(client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 20  # the chat template's system prompt is there
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2-135m", messages=msgs, max_tokens=24, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == text and len(pieces) >= 2  # a step appends up to 8 tokens


def test_stop_strings_and_logprobs_in_a_stream(client):
    msgs = [{"role": "system", "content": "You count."},
            {"role": "user", "content": "Count from 1 to 10, one number per line."}]
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=40,
                                                 temperature=0, stop=["5"], logprobs=True, top_logprobs=2,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "4" in text and "5" not in text, text  # nothing of the stop string was streamed
    assert chunks[-1].choices[0].finish_reason == "stop"
    lps = [e for c in chunks for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert lps and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lps)
    # completions take text prompts with a tokenizer
    r = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4,
                                  temperature=0)
    assert "Paris" in r.choices[0].text
