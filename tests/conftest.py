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
