"""Collective IR ops: what a tensor-parallel graph (llmaccel/parallel/tp.py) adds.

    all_reduce(x, *, group)   the sum of x over the ranks of the torch.distributed group named
                              `group` (every rank holds a partial sum of a row-parallel linear)

The reference is torch's functional collective (all_reduce, then wait_tensor): Inductor and CUDA
graphs capture it, and it runs on any backend (gloo on CPUs, NCCL on GPUs).
"""
from __future__ import annotations

import torch


def all_reduce(x: torch.Tensor, *, group: str) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))
