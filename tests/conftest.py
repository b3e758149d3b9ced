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


# On the CPU, LLM compiles its decode step by default (seconds of Inductor a model) and runs an
# fp32 graph's linears in bf16 where the CPU has bf16 dot products: tests run the exact fp32 path,
# uncompiled (set for the whole session, so that module-scoped fixtures and child processes see
# it too), unless marked `cpu_fast` (tests/runtime/test_cpu_fast.py) or passing compile=.
CPU_EXACT = {"LLMACCEL_CPU_COMPILE": "0", "LLMACCEL_CPU_BF16": "0"}
for _k, _v in CPU_EXACT.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(autouse=True)
def _cpu_fast_when_marked(request, monkeypatch):
    if "cpu_fast" in request.keywords:
        for k, v in CPU_EXACT.items():
            if os.environ.get(k) == v:
                monkeypatch.delenv(k)
