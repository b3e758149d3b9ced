"""relu: ReLUfication of the gated MLP, so most down-projection inputs are exact zeros.

silu_mul(gate, up) becomes ReLU(gate - shift) * up (`relu`) or ReLU(gate - shift) * ReLU(up)
(`drelu`, TurboSparse). The change in the activation's mean is folded into a down-projection
bias (`relu.bias_correct`, measured on calibration text), which recovers part of the loss
before any healing. The down-projection becomes `sparse_down` (weight stored transposed) so a
kernel can skip the rows of zero activations. Per-layer sparsity is measured on calibration
text after the rewrite and reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.ops.sparse import relu_glu, sparse_down
from llmaccel.passes.base import Pass, PassContext, PassResult
from llmaccel.ir import add_weight, is_op, op_nodes, positions, probe, prune_weights, replace_weight, weight_of

ACT_OPS = (ops.relu_mul, relu_glu)


@dataclass
class ReluConfig:
    kind: Literal["relu", "drelu"] = "relu"
    shift: float = 0.0          # ReLU(gate - shift): a positive shift buys sparsity
    bias_correct: bool = True   # fold the activation's mean change into a down bias
    sparse_op: bool = True      # down-projection -> sparse_down (False: keep a plain linear)
    calib_samples: int = 8
    calib_seq_len: int = 256

    def __post_init__(self):
        if self.calib_samples < 1 or self.calib_seq_len < 2:
            raise LlmaccelError("relu.calib_samples and relu.calib_seq_len must be positive")


def _probe(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], ids: torch.Tensor) -> list:
    """Values of `nodes` (by name) for one forward on ids, from a copy of the graph."""
    with torch.no_grad():
        return list(probe(gm, nodes)(ids, positions(ids), None))


@torch.no_grad()
def measure_sparsity(gm: torch.fx.GraphModule, ids: torch.Tensor) -> list[float]:
    """Fraction of exact zeros in each ReLU-gated MLP activation on ids, in graph order."""
    acts = op_nodes(gm, *ACT_OPS)
    return [(v == 0).float().mean().item() for v in _probe(gm, acts, ids)]


def _down_of(act: torch.fx.Node) -> torch.fx.Node:
    users = list(act.users)
    if len(users) != 1 or not is_op(users[0], ops.linear) or users[0].args[0] is not act:
        raise LlmaccelError("relu: a gated MLP's activation is not read by one down-projection linear")
    return users[0]


class Relu(Pass):
    name = "relu"
    summary = "ReLUfication of the gated MLP (relu or dReLU), sparsity measured, sparse down-projection"
    exact = False
    config_cls = ReluConfig

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        mlps = op_nodes(gm, ops.silu_mul)
        if not mlps:
            fam = ctx.config.family if ctx.config is not None else "this"
            raise LlmaccelError(f"relu: the {fam} graph has no SiLU-gated MLP (silu_mul) to ReLUfy")
        ids = ctx.calib_tokens(c.calib_samples, c.calib_seq_len).to(ctx.device)
        downs = [_down_of(a) for a in mlps]
        corrections = self._mean_shift(gm, mlps, ids) if c.bias_correct else [None] * len(mlps)
        for act, down, delta in zip(mlps, downs, corrections):
            if c.kind == "relu" and not c.shift:
                act.target, act.kwargs = ops.relu_mul, {}
            else:
                act.target, act.kwargs = relu_glu, {"kind": c.kind, "shift": float(c.shift)}
            if delta is not None:
                self._add_bias(gm, down, delta)
        sparsity = measure_sparsity(gm, ids)
        if c.sparse_op:
            for down, s in zip(downs, sparsity):
                self._to_sparse(gm, down, s)
        prune_weights(gm)
        mean = sum(sparsity) / len(sparsity)
        return PassResult(gm, len(mlps), {
            "kind": c.kind, "mlps": len(mlps), "sparsity_mean": round(mean, 4),
            "sparsity_min": round(min(sparsity), 4), "sparsity_max": round(max(sparsity), 4),
            "sparsity_per_layer": [round(s, 4) for s in sparsity],
            "down_bytes_skippable": round(mean, 4)})

    def _mean_shift(self, gm, mlps, ids) -> list[torch.Tensor]:
        """Per MLP, mean over calibration tokens of (old activation - new activation)."""
        c = self.config
        vals = _probe(gm, [n for a in mlps for n in a.args[:2]], ids)
        out = []
        for i in range(len(mlps)):
            g, u = vals[2 * i].float(), vals[2 * i + 1].float()
            new = relu_glu(g, u, kind=c.kind, shift=c.shift)
            out.append((F.silu(g) * u - new).flatten(0, -2).mean(0))
        return out

    def _add_bias(self, gm, down: torch.fx.Node, delta: torch.Tensor) -> None:
        w = weight_of(gm, down.args[1])
        b_node = down.args[2] if len(down.args) > 2 else down.kwargs.get("bias")
        b = weight_of(gm, b_node)
        extra = (w.double() @ delta.double().to(w.device)).to(w.dtype)
        if b is None:
            name = down.args[1].target.removesuffix("weight") + "bias"
            new = add_weight(gm, name, extra, down)
        else:
            new = replace_weight(gm, b_node, b + extra, down)
        down.args, down.kwargs = (down.args[0], down.args[1], new), {}

    def _to_sparse(self, gm, down: torch.fx.Node, s: float) -> None:
        w = weight_of(gm, down.args[1])
        b_node = down.args[2] if len(down.args) > 2 else down.kwargs.get("bias")
        wt = add_weight(gm, down.args[1].target + "_t", w.t().contiguous(), down)
        with gm.graph.inserting_before(down):
            new = gm.graph.call_function(sparse_down, (down.args[0], wt, b_node), {"sparsity": round(s, 4)})
        down.replace_all_uses_with(new)
        gm.graph.erase_node(down)


PASS = Relu
