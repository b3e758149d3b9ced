"""IR ops for activation-sparse MLPs (ReLUfication, TurboSparse dReLU).

`sparse_down` is the MLP down-projection whose input is mostly exact zeros. Its weight is
stored transposed, (F, D), so that each intermediate channel's weights are one contiguous row:
a kernel that skips a zero activation skips a whole row of memory traffic. The reference is the
dense product; skipping zeros changes nothing but the cost. `sparsity` is the fraction of zero
activations measured on calibration text, a hint for the lowering (dense vs sparse kernel).
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["sparse_down", "relu_glu", "relu_glu_held"]


def sparse_down(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None, *,
                sparsity: float = 0.0) -> torch.Tensor:
    """x (..., F) @ weight_t (F, D) (+ bias): a linear with a transposed weight."""
    out = torch.matmul(x, weight_t)
    return out if bias is None else out + bias


def relu_glu(gate: torch.Tensor, up: torch.Tensor, *, kind: str = "relu",
             shift: float = 0.0) -> torch.Tensor:
    """ReLU-gated MLP activation.

    kind "relu": ReLU(gate - shift) * up; "drelu": ReLU(gate - shift) * ReLU(up) (TurboSparse).
    A positive shift raises sparsity (a shifted ReLU, as in ReLU^2 / ProSparse-style thresholds).
    """
    g = F.relu(gate - shift) if shift else F.relu(gate)
    return g * (F.relu(up) if kind == "drelu" else up)


def relu_glu_held(gate: torch.Tensor, up: torch.Tensor, shift: torch.Tensor, *,
                  kind: str = "relu") -> torch.Tensor:
    """relu_glu with its shift a 0-dim tensor: the training form of a relu pass that holds a
    target sparsity through the heal (the heal moves the shift without recompiling)."""
    g = F.relu(gate - shift.to(gate.dtype))
    return g * (F.relu(up) if kind == "drelu" else up)


torch.fx.wrap("sparse_down")
torch.fx.wrap("relu_glu")
torch.fx.wrap("relu_glu_held")
