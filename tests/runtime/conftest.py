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


@pytest.fixture(scope="module")
def tiny():
    """The tiny Llama preset, loaded once per test module."""
    from llmaccel import load
    return load("preset:tiny-llama")
