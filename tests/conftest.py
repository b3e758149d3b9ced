import os

import torch

# Without a GPU, Triton kernels run in the interpreter. Set here, before any test module imports
# triton, and only then: on a GPU machine the same session must compile real kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    if os.environ.get("LLMACCEL_SKIP_REAL") == "1":
        skip = pytest.mark.skip(reason="LLMACCEL_SKIP_REAL=1")
        for item in items:
            if "real" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(autouse=True)
def _cpu_decode_uncompiled(request, monkeypatch):
    """LLM compiles its CPU decode step by default (seconds of Inductor a model); tests run it
    uncompiled unless marked `cpu_compile` (tests/runtime/test_cpu_compile.py), or pass compile=."""
    if "cpu_compile" not in request.keywords:
        from llmaccel.runtime import decode
        monkeypatch.setattr(decode, "cpu_compiler", lambda: "off in tests")
