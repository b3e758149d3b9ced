"""Triton kernels, one module per op family, each registered as torch.ops.llmaccel.* custom ops."""
from __future__ import annotations

import functools
import os

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim has unit stride (views of a wider buffer are read in place,
    with their row strides), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, last dim) with unit stride in the last dim: a view where the rows are evenly
    strided (a view of a wider buffer is read in place), else a copy."""
    return unit_stride(x).reshape(-1, x.shape[-1])


def device_index(device: torch.device) -> int:
    """The index of a CUDA device ("cuda" alone: the current one): the key of per-device caches."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Under the interpreter there is no device to ask: launch configurations are chosen as for an
# H200 (132 SMs), so the CPU tests run the tile and split choices the GPU runs.
INTERPRETER_SMS = 132


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the property query is slow);
    INTERPRETER_SMS for any other device."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _sm_count(device_index(device))


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str | None:
    """The CUDA device's name (the key of measured tuning tables); None for other devices."""
    if device.type != "cuda":
        return None
    return _device_name(device_index(device))


def registered(name: str) -> bool:
    """Whether torch.ops.llmaccel.<name> exists: a kernel module imported afresh (tests import
    them again under the Triton interpreter) must not register its custom ops twice."""
    try:
        getattr(torch.ops.llmaccel, name)
        return True
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _gdc_capable(device_index: int) -> bool:
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return (torch.version.hip is None and hasattr(cuda, "gdc_wait")  # griddepcontrol is PTX
            and torch.cuda.get_device_capability(device_index)[0] >= 9)


def pdl_enabled(x: torch.Tensor) -> bool:
    """Whether kernels reading x launch with programmatic dependent launch: a CUDA tensor on
    sm90+ and a compiled (not interpreted) Triton with grid dependency control."""
    if not x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _gdc_capable(device_index(x.device))
