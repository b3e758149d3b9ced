"""Triton kernels, one module per op family, each registered as torch.ops.llmaccel.* custom ops."""
from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def registered(name: str) -> bool:
    """Whether torch.ops.llmaccel.<name> exists: a kernel module imported afresh (tests import
    them again under the Triton interpreter) must not register its custom ops twice."""
    try:
        getattr(torch.ops.llmaccel, name)
        return True
    except (AttributeError, RuntimeError):
        return False
