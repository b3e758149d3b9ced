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

`relu.sparsity` asks for a mean sparsity instead of a shift: the one shift of all layers that
gives it on the calibration tokens is solved for (a quantile of the gate values), before the
bias correction and the fit, which move the later layers' gates a little (SmolLM2-135M: relu at
0.72 measures 71.7%, 73.0% after the fit; drelu at 0.86 with the fit 88.4%; the stats give the
measured figure). With a `heal` after it the pass emits a training form (`relu_glu_held`, the
shift a 0-dim buffer) and holds that sparsity through the heal: every 2% of training progress
the shift is solved again on the same tokens, so the heal improves quality at the asked
sparsity instead of trading sparsity for it (with a fixed shift of 0.25 an H200 heal took relu
from 74.9% to 69.5% and drelu from 88.6% to 82.4%; docs/quality.md); finishing the
training form solves it once more and writes it back as a float. On a graph ReLUfied before (an artifact healed further)
`relu.sparsity` solves the shift again and holds it through a heal after it; nothing else moves.

`relu.ramp=R` (with `relu.sparsity` and a heal) raises the sparsity gradually instead (ProSparse's
progressive sparsification): the pass ReLUfies at shift 0 (its bias correction and fit there, the
least damaged ReLU model), and the held target rises linearly from that graph's own sparsity to
`relu.sparsity` over the first R of the heal's progress, then stays there.
"""
from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.ops.sparse import relu_glu, relu_glu_held, sparse_down
from llmaccel.passes.base import Pass, PassContext, PassResult, TrainingForm
from llmaccel.passes.fitting import FitOptions, fit_sites, quality, rel_err, ridge_refit_validated, snapshot, subgraph
from llmaccel.ir import add_weight, is_op, op_nodes, positions, probe, prune_weights, replace_weight, weight_of

ACT_OPS = (ops.relu_mul, relu_glu, relu_glu_held)
_SHIFT = "relu_shift"   # the training form's shift buffer, read by every relu_glu_held node
_HOLD_EVERY = 0.02      # training progress between two solves of the held shift
_HOLD_WINDOWS = 4       # calibration windows the held sparsity is measured on
_SOLVE_ROUNDS = 2       # solves of the shift on the rewritten graph after the first on the source's


@dataclass
class ReluConfig(FitOptions):
    kind: Literal["relu", "drelu"] = "relu"
    shift: float = 0.0          # ReLU(gate - shift): a positive shift buys sparsity
    # target mean sparsity (fraction of zero activations on the calibration tokens): the shift
    # is solved for it and held through a later heal (module docstring); 0 = `shift` as given
    sparsity: float = 0.0
    # fraction of the heal over which the held sparsity rises from shift 0's to `sparsity`; off:
    # 0.5 ended worse than holding the target from the start (H100, docs/quality.md)
    ramp: float = 0.0
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
        if not 0 <= self.sparsity < 1:
            raise LlmaccelError(f"relu.sparsity must be in [0, 1), got {self.sparsity}")
        if self.sparsity and self.shift:
            raise LlmaccelError("set relu.shift or relu.sparsity, not both (the shift is solved for the sparsity)")
        if not 0 <= self.ramp < 1:
            raise LlmaccelError(f"relu.ramp must be a fraction of the heal in [0, 1), got {self.ramp}")
        if self.ramp and not self.sparsity:
            raise LlmaccelError("relu.ramp raises the sparsity to relu.sparsity: set relu.sparsity too")


def _probe(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], ids: torch.Tensor) -> list:
    """Values of `nodes` (by name) for one forward on ids, from a copy of the graph."""
    with torch.no_grad():
        return list(probe(gm, nodes)(ids, positions(ids), None))


@torch.no_grad()
def measure_sparsity(gm: torch.fx.GraphModule, ids: torch.Tensor) -> list[float]:
    """Fraction of exact zeros in each ReLU-gated MLP activation on ids, in graph order."""
    acts = op_nodes(gm, *ACT_OPS)
    return [(v == 0).float().mean().item() for v in _probe(gm, acts, ids)]


def shift_for(gates: list[torch.Tensor], ups: list[torch.Tensor], kind: str, target: float) -> float:
    """The one shift at which ReLU-gated activations of all layers together are `target` zeros.
    An activation is zero when its gate is at most the shift (drelu: or its up is at most 0), so
    the shift is an order statistic of the gates that could be nonzero."""
    total = sum(g.numel() for g in gates)
    if kind == "drelu":
        cand = torch.cat([g[u > 0].float() for g, u in zip(gates, ups)])
    else:
        cand = torch.cat([g.flatten().float() for g in gates])
    k = math.ceil(target * total) - (total - cand.numel())
    if k < 1:
        raise LlmaccelError(f"relu.sparsity={target}: dReLU is already {1 - cand.numel() / total:.1%} "
                            f"sparse at any shift (its up projection's negatives); ask for more")
    return cand.kthvalue(min(k, cand.numel())).values.item()


class _Hold:
    """What the training form needs to hold its sparsity: the tokens it is measured on, the
    target, and the training progress of the next solve."""

    def __init__(self, ids: torch.Tensor, target: float, kind: str, dtype: torch.dtype,
                 start: float = 0.0, ramp: float = 0.0):
        # solved at the heal's first step too: the fit and the earlier layers' ReLUs moved the gates
        self.ids, self.target, self.kind, self.next = ids, target, kind, 0.0
        self.start, self.ramp = start, ramp   # the target at progress 0, reached at `ramp`
        # a model held in a lower precision is probed under autocast to it: during the heal its
        # trained weights are fp32 master copies beside its other weights (as heal.data.DomainEval)
        self.amp = None if dtype == torch.float32 else dtype
        # the probe of the gates and ups, built once (building it copies the graph: ~0.1 s); it
        # reads gm's own weight objects, which the heal updates in place
        self.probe: torch.fx.GraphModule | None = None

    def target_at(self, frac: float) -> float:
        if frac >= self.ramp:
            return self.target
        return self.start + (self.target - self.start) * frac / self.ramp

    @torch.no_grad()
    def solve(self, gm: torch.fx.GraphModule, frac: float = 1.0) -> float:
        acts = op_nodes(gm, relu_glu_held)
        if self.probe is None:
            self.probe = probe(gm, [n for a in acts for n in a.args[:2]])
        amp = torch.autocast(self.ids.device.type, self.amp) if self.amp else contextlib.nullcontext()
        with amp:
            vals = self.probe(self.ids, positions(self.ids), None)
        shift = shift_for(vals[0::2], vals[1::2], self.kind, self.target_at(frac))
        weight_of(gm, acts[0].args[2]).fill_(shift)
        return shift


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


def _hint_sparsity(acts: list[torch.fx.Node], sparsity: list[float]) -> None:
    """Each sparse_down's `sparsity` (the lowering's hint) set to its activation's measured one."""
    for act, s in zip(acts, sparsity):
        down = next(iter(act.users))
        if is_op(down, sparse_down):
            down.kwargs = {**down.kwargs, "sparsity": round(s, 4)}


def _down_of(act: torch.fx.Node) -> torch.fx.Node:
    users = list(act.users)
    if len(users) != 1 or not is_op(users[0], ops.linear) or users[0].args[0] is not act:
        raise LlmaccelError("relu: a gated MLP's activation is not read by one down-projection linear")
    return users[0]


class Relu(Pass):
    name = "relu"
    before = ("quant", "bitlinear")  # it reads the down projection as a plain linear
    summary = "ReLUfication of the gated MLP (relu or dReLU), sparsity measured, sparse down-projection"
    exact = False
    config_cls = ReluConfig

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        mlps = op_nodes(gm, ops.silu_mul)
        if not mlps and op_nodes(gm, ops.relu_mul, relu_glu) and c.sparsity:
            return self._retarget(gm, ctx)
        if c.ramp and not ctx.trained:
            raise LlmaccelError("relu.ramp raises the sparsity during a heal: add heal after relu")
        if not mlps:
            fam = ctx.config.family if ctx.config is not None else "this"
            raise LlmaccelError(f"relu: the {fam} graph has no SiLU-gated MLP (silu_mul) to ReLUfy "
                                f"(a ReLUfied one takes relu.sparsity, to solve and hold it again)")
        ids = ctx.calib_tokens(c.calib_samples, c.calib_seq_len).to(ctx.device)
        downs = [_down_of(a) for a in mlps]
        orig = snapshot(gm) if c.fit else None
        gate_up = [n for a in mlps for n in a.args[:2]]
        vals = _probe(gm, gate_up, ids) if c.bias_correct or c.sparsity else []
        shift = c.shift
        if c.sparsity and not c.ramp:   # ramped: rewritten at shift 0, the heal raises it
            shift = shift_for(vals[0::2], vals[1::2], c.kind, c.sparsity)
            for _ in range(_SOLVE_ROUNDS):  # the earlier layers' ReLUs move the later gates
                self._set_acts(mlps, shift)
                v = _probe(gm, gate_up, ids)
                shift = shift_for(v[0::2], v[1::2], c.kind, c.sparsity)
                del v
        corrections = self._mean_shift(vals, shift) if c.bias_correct else [None] * len(mlps)
        del vals
        self._set_acts(mlps, shift)
        for down, delta in zip(downs, corrections):
            if delta is not None:
                self._add_bias(gm, down, delta)
        fit = self._fit(gm, ctx, orig, mlps, downs) if c.fit else None
        sparsity = measure_sparsity(gm, ids)
        if c.sparse_op:
            for down, s in zip(downs, sparsity):
                self._to_sparse(gm, down, s)
        held = bool(c.sparsity) and ctx.trained
        if held:
            self._hold(gm, mlps, ids, shift, start=sum(sparsity) / len(sparsity))
        prune_weights(gm)
        mean = sum(sparsity) / len(sparsity)
        return PassResult(gm, len(mlps), {
            "kind": c.kind, "mlps": len(mlps), "shift": round(float(shift), 6),
            **({"sparsity_target": c.sparsity, "held_through_heal": held} if c.sparsity else {}),
            **({"ramp": c.ramp} if c.ramp else {}),
            "sparsity_mean": round(mean, 4),
            "sparsity_min": round(min(sparsity), 4), "sparsity_max": round(max(sparsity), 4),
            "sparsity_per_layer": [round(s, 4) for s in sparsity],
            "down_bytes_skippable": round(mean, 4), **({"fit": fit} if fit is not None else {})})

    def _retarget(self, gm, ctx) -> PassResult:
        """A graph ReLUfied before (an artifact healed further): the shift solved again for
        `relu.sparsity` and, with a heal after it, held through that heal. The MLPs' weights,
        biases and fit stay as they were."""
        c = self.config
        acts = op_nodes(gm, ops.relu_mul, relu_glu)
        kinds = {a.kwargs.get("kind", "relu") for a in acts}
        if kinds != {c.kind}:
            raise LlmaccelError(f"relu: the graph's MLPs are ReLUfied with kind {', '.join(sorted(kinds))}, "
                                f"not relu.kind={c.kind}")
        if c.fit or c.ramp:
            what = "relu.fit" if c.fit else "relu.ramp"
            raise LlmaccelError(f"{what}: the graph's MLPs are ReLUfied already; it needs the SiLU "
                                "MLPs they replaced")
        ids = ctx.calib_tokens(c.calib_samples, c.calib_seq_len).to(ctx.device)
        gate_up = [n for a in acts for n in a.args[:2]]
        before = float(acts[0].kwargs.get("shift", 0.0))
        for _ in range(_SOLVE_ROUNDS):  # each layer's gates move with the earlier layers' shift
            v = _probe(gm, gate_up, ids)
            shift = shift_for(v[0::2], v[1::2], c.kind, c.sparsity)
            del v
            self._set_acts(acts, shift)
        sparsity = measure_sparsity(gm, ids)
        _hint_sparsity(acts, sparsity)
        held = ctx.trained
        if held:
            self._hold(gm, acts, ids, shift)
        mean = sum(sparsity) / len(sparsity)
        return PassResult(gm, len(acts), {
            "kind": c.kind, "mlps": len(acts), "retargeted": True, "shift_before": round(before, 6),
            "shift": round(float(shift), 6), "sparsity_target": c.sparsity, "held_through_heal": held,
            "sparsity_mean": round(mean, 4), "sparsity_min": round(min(sparsity), 4),
            "sparsity_max": round(max(sparsity), 4), "sparsity_per_layer": [round(x, 4) for x in sparsity]})

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

    def _set_acts(self, acts, shift: float) -> None:
        for act in acts:
            if self.config.kind == "relu" and not shift:
                act.target, act.kwargs = ops.relu_mul, {}
            else:
                act.target, act.kwargs = relu_glu, {"kind": self.config.kind, "shift": float(shift)}

    def _mean_shift(self, vals: list[torch.Tensor], shift: float) -> list[torch.Tensor]:
        """Per MLP, mean over calibration tokens of (old activation - new activation), from the
        MLPs' (gate, up) values in `vals`."""
        out = []
        for i in range(0, len(vals), 2):
            g, u = vals[i].float(), vals[i + 1].float()
            new = relu_glu(g, u, kind=self.config.kind, shift=shift)
            out.append((F.silu(g) * u - new).flatten(0, -2).mean(0))
        return out

    def _hold(self, gm, acts, ids: torch.Tensor, shift: float, start: float = 0.0) -> None:
        """The training form: every activation reads one shift buffer that its schedule moves."""
        # a buffer, not a parameter: the heal trains parameters
        gm.register_buffer(_SHIFT, torch.tensor(float(shift), device=next(gm.parameters()).device))
        with gm.graph.inserting_before(acts[0]):
            buf = gm.graph.get_attr(_SHIFT)
        for act in acts:
            act.target, act.args, act.kwargs = relu_glu_held, (*act.args[:2], buf), {"kind": self.config.kind}
        dtypes = [p.dtype for p in gm.parameters() if p.is_floating_point()]
        dtype = max(set(dtypes), key=dtypes.count)   # the model's own (the heal's masters are fp32)
        c = self.config
        gm.relu_hold = _Hold(ids[:_HOLD_WINDOWS], c.sparsity, c.kind, dtype, start, c.ramp)

    @classmethod
    def training_form(cls, gm: torch.fx.GraphModule) -> TrainingForm:
        return TrainingForm(lambda frac: cls._schedule(gm, frac), lambda: cls._finish(gm))

    @classmethod
    def _schedule(cls, gm: torch.fx.GraphModule, frac: float) -> None:
        hold = getattr(gm, "relu_hold", None)
        if hold is None or frac >= 1.0 or frac < hold.next:  # 1.0: the inference state, as it is
            return
        hold.next = frac + _HOLD_EVERY
        hold.solve(gm, frac)

    @classmethod
    def _finish(cls, gm: torch.fx.GraphModule) -> dict:
        acts = op_nodes(gm, relu_glu_held)
        if not acts:
            return {}
        # without the hold (a pass in between rebuilt the module without it): the shift as it is
        hold = getattr(gm, "relu_hold", None)
        shift = hold.solve(gm) if hold is not None else float(weight_of(gm, acts[0].args[2]))
        for act in acts:
            act.target, act.args = relu_glu, act.args[:2]
            act.kwargs = {**act.kwargs, "shift": shift}
        prune_weights(gm)
        if hold is None:
            return {"relu_held": {"shift": round(shift, 6), "held": False}}
        del gm.relu_hold
        gm.recompile()
        sparsity = measure_sparsity(gm, hold.ids)
        _hint_sparsity(acts, sparsity)   # measured on the healed weights
        return {"relu_held": {"target": hold.target, "shift": round(shift, 6),
                              "sparsity_mean": round(sum(sparsity) / len(sparsity), 4),
                              "sparsity_per_layer": [round(s, 4) for s in sparsity]}}

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
