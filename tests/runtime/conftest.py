import pytest
import torch

from llmaccel import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


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


def lowered(model):
    """`model` with its graph lowered as the engine's steps lower it (kernels or CPU forms): the
    reference executor over the same op numerics as LLM."""
    from llmaccel.codegen.lower import lower
    from llmaccel.compiler.model import Model

    gm, _ = lower(model.gm, max_len=model.config.max_position)
    return Model(gm, model.config, source=model.source, dtype=model.dtype, device=model.device)


@pytest.fixture(scope="module")
def tiny():
    """The tiny Llama preset, loaded once per test module."""
    from llmaccel import load
    return load("preset:tiny-llama")


@pytest.fixture(scope="module")
def prompts():
    """Six prompts of 1-40 tokens (a module may define its own)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 33, 1, 40, 12)]


@pytest.fixture(scope="module")
def reference(tiny, prompts):
    """The reference executor's greedy tokens for `prompts`."""
    return [list(tiny.generate_ids(p, GREEDY)) for p in prompts]
