import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Runtime tests run many tiny ops: one intra-op thread avoids thread hand-off costs that
    dominate on a busy 2-core machine. Restored afterwards for other test directories."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def check_logprobs(model, prompts, outs, top: int, n: int) -> None:
    """Each output token's logprob is the reference executor's log-softmax at its position, and
    its top list (of `top`) starts with the token itself (greedy outputs)."""
    for prompt, o in zip(prompts, outs):
        assert len(o.logprobs) == len(o.token_ids) == n
        ls = torch.log_softmax(model.logits(torch.tensor([prompt + o.token_ids]))[0].float(), -1)
        for j, (t, e) in enumerate(zip(o.token_ids, o.logprobs)):
            want = ls[len(prompt) - 1 + j]
            assert e["token"] == t and abs(e["logprob"] - float(want[t])) < 1e-4
            assert len(e["top"]) == top and (not top or e["top"][0][0] == t)
            if top:
                assert abs(e["top"][-1][1] - float(want.topk(top).values[-1])) < 1e-4


@pytest.fixture(scope="module")
def tiny():
    """The tiny Llama preset, loaded once per test module."""
    from llmaccel import load
    return load("preset:tiny-llama")
