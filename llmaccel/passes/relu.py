"""relu: ReLUfication of the gated MLP, so most down-projection inputs are exact zeros.

silu_mul(gate, up) becomes ReLU(gate - shift) * up (`relu`) or ReLU(gate - shift) * ReLU(up)
(`drelu`, TurboSparse). The change in the activation's mean is folded into a down-projection
bias (`relu.bias_correct`, measured on calibration text), which recovers part of the loss
before any healing. With `relu.fit=true` (fitting.py) each down-projection's weight is then
refitted by least squares, layer by layer, so that it maps the ReLU activations at hand to the
original MLP's output (ridge chosen on held-out tokens, kept only where it lowers the error).
The down-projection becomes `sparse_down` (weight stored transposed) so a kernel can skip the
rows of zero activations. Per-layer sparsity is measured on calibration text after the rewrite
and reported.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.ops.sparse import relu_glu, sparse_down
from llmaccel.passes.base import Pass, PassContext, PassResult
from llmaccel.passes.fitting import FitOptions, fit_sites, quality, rel_err, ridge_refit_validated, snapshot, subgraph
from llmaccel.ir import add_weight, is_op, op_nodes, positions, probe, prune_weights, replace_weight, weight_of

ACT_OPS = (ops.relu_mul, relu_glu)


@dataclass
class ReluConfig(FitOptions):
    kind: Literal["relu", "drelu"] = "relu"
    shift: float = 0.0          # ReLU(gate - shift): a positive shift buys sparsity
    bias_correct: bool = True   # fold the activation's mean change into a down bias
    sparse_op: bool = True      # down-projection -> sparse_down (False: keep a plain linear)
    calib_samples: int = 8
    calib_seq_len: int = 256
    # fit: each down-projection fitted to the original MLP on the same inputs. Fitted to the
    # source model's outputs instead (each layer also absorbing the drift before it), the
    # per-layer error fell further but the model got worse end to end (SmolLM2-135M, shift 0.25:
    # KL on wikitext2 3.83 unfitted, 1.69 local, 7.61 source; docs/quality.md)
    fit_target: Literal["source", "local"] = "local"

    def __post_init__(self):
        super().__post_init__()
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


def _mlp_input(act: torch.fx.Node) -> torch.fx.Node:
    """The node the gate projection reads (the normed hidden state), through a fused split."""
    g = act.args[0]
    if is_op(g, operator.getitem):
        g = g.args[0].args[0]   # getitem(split(linear))
    if not is_op(g, ops.linear):
        raise LlmaccelError("relu.fit: a gated MLP's gate is not a float linear (quantized?); fit before quant")
    return g.args[0]


def _down_refit(gm, orig, x: torch.fx.Node, down: torch.fx.Node, errs: list, updates: list):
    """Fit callback of one down-projection: W_down by validated ridge from the ReLU activations
    at hand to the original MLP's output (fit_target=source: the original model's, on the same
    text; local: the original MLP on the same input), its bias kept."""
    sub = subgraph(orig, [x.name], down.name)

    def site(interp, n):
        z = interp.value(n.args[0])
        y = (interp.source.value(n.name) if interp.source is not None else sub(interp.value(x))).float()
        interp.kept.pop(x, None)
        w = weight_of(gm, n.args[1])
        b = weight_of(gm, n.args[2] if len(n.args) > 2 else None)
        Z, Y = z.flatten(0, -2).float(), y.flatten(0, -2)
        # each token's error relative to its own output: a few tokens (attention sinks) carry
        # MLP outputs 10-40x the median norm and would otherwise own the least squares
        scale = 1 / Y.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        new_w = ridge_refit_validated(w, Z * scale, (Y - (0 if b is None else b.float())) * scale)
        bf = None if b is None else b.float()   # the error in fp32 whatever the model's dtype
        before, after = (rel_err(F.linear(Z, wt.float(), bf) * scale, Y * scale) for wt in (w, new_w))
        errs.append((before, min(before, after)))
        if after >= before:
            return F.linear(z, w, b)
        updates.append(lambda: setattr(n, "args", (n.args[0], replace_weight(gm, n.args[1], new_w, n), *n.args[2:])))
        return F.linear(z, new_w, b)
    return site


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
        orig = snapshot(gm) if c.fit else None
        corrections = self._mean_shift(gm, mlps, ids) if c.bias_correct else [None] * len(mlps)
        for act, down, delta in zip(mlps, downs, corrections):
            if c.kind == "relu" and not c.shift:
                act.target, act.kwargs = ops.relu_mul, {}
            else:
                act.target, act.kwargs = relu_glu, {"kind": c.kind, "shift": float(c.shift)}
            if delta is not None:
                self._add_bias(gm, down, delta)
        fit = self._fit(gm, ctx, orig, mlps, downs) if c.fit else None
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
            "down_bytes_skippable": round(mean, 4), **({"fit": fit} if fit is not None else {})})

    def _fit(self, gm, ctx, orig, mlps, downs) -> dict:
        """Each down-projection refitted to the original MLP's output (module docstring)."""
        c = self.config
        gm.graph.lint()
        gm.recompile()
        unfitted = snapshot(gm)

        def make(errs, updates):
            sites, keep = {}, set()
            for act, down in zip(mlps, downs):
                x = _mlp_input(act)
                keep.add(x)
                sites[down] = _down_refit(gm, orig, x, down, errs, updates)
            return sites, keep
        st = fit_sites(gm, ctx, c, make, "relu fit", orig)
        if c.fit_report_tokens:
            st["quality"] = quality(ctx, {"unfitted": unfitted, "fitted": gm}, c.fit_report_tokens)
        return st

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
