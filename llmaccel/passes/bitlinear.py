"""bitlinear: BitNet b1.58 ternary weights and per-token int8 activations for the decoder linears.

Every selected linear (default: all decoder linears; never the embedding or the LM head, which
are separate ops) becomes a BitLinear. Linears that read the same input are concatenated into
one op and split after it: q, k, v share the attention norm's output and gate, up the MLP norm's.
Where that input is an RMSNorm, the norm is absorbed into the op (rms_norm_bitlinear, the
MatMul-free LM fusion). Concatenating rather than emitting one fused op per linear keeps the
norm and the activation quantization at one computation per token (they are identical for the
linears of a group: the quantization is per token of the shared input) and makes one kernel
launch per group, which is what decode time is made of at these sizes; per-tensor scales stay
per original linear because the scale is stored per output row. Linears with no norm before
them (o, down; every GPT-2 linear, whose norms are LayerNorms) get plain `bitlinear`: no norm
is inserted, since that would change what a pretrained model computes.

With `heal` later in the pass list the pass emits the training form (fp latent weights,
straight-through fake quantization, llmaccel/ops/bitlinear.py) and its training form's finish
packs it. Without heal the pass builds the same training form and packs it at once, so both
paths share one packing routine: finishing it on unchanged latent weights gives exactly the non-heal graph.

Scale (`bitlinear.scale`): BitNet b1.58 uses one absmean per weight tensor; per output channel is
the default here. Converting a pretrained model (SmolLM2-135M, no healing, 8192 held-out
tokens) it gives a lower weight error (||W - sT|| / ||W|| 0.529 vs 0.547), KL 13.98 vs 14.91
and 2.3x lower perplexity, at the same storage (a scale per row either way) and the same
kernel. Nearly all of the loss is the ternary weights: int8 per-token activations alone cost
+2.6% perplexity. Unhealed, the model is destroyed (ppl 3.4e7, KL 14.0 against source ppl 26.3);
20 heal steps on a CPU (2,560 tokens, lr 2e-3) bring it to ppl 20,713, KL 6.48.

`fuse` must not have run first: it folds the norm scales into the linears and fuses the residual
add into the norm, which takes away the norms this pass absorbs; run `bitlinear,fuse` instead.
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.ops import bitlinear as bl
from llmaccel.passes.base import Pass, PassContext, PassResult, TrainingForm
from llmaccel.passes.bitlinear_fit import ternary_fit
from llmaccel.passes.fitting import FitOptions, fit_sites, quality, snapshot
from llmaccel.ir import add_weight, is_op, op_nodes, prune_weights, weight_of

_TRAIN_OPS = (bl.bitlinear_train, bl.rms_norm_bitlinear_train)
_LAMBDA = "bitlinear_lambda"     # 0-d buffer on the graph module (a buffer: heal never trains it)
_WARMUP = "bitlinear_warmup"     # plain float attribute (no graph node reads it)
_LEAVES = ("q", "k", "v", "o", "gate", "up", "down", "fc", "proj")


@dataclass
class BitlinearConfig(FitOptions):
    linears: str = "all"        # "all" or a comma list of q,k,v,o,gate,up,down (fc,proj for GPT-2)
    scale: Literal["per_tensor", "per_channel"] = "per_channel"   # measured better (module docstring)
    fuse_norm: bool = True      # absorb the RMSNorm before a linear group into the op
    warmup: float = 0.0         # heal: fraction of the steps over which quantization ramps in

    def __post_init__(self):
        super().__post_init__()
        if self.scale not in bl.SCALES:
            raise LlmaccelError(f"bitlinear.scale={self.scale}: expected per_tensor or per_channel")
        if self.linears != "all":
            bad = sorted(set(self.names()) - set(_LEAVES))
            if bad or not self.names():
                raise LlmaccelError(f"bitlinear.linears={self.linears}: expected 'all' or a comma "
                                    f"list of {','.join(_LEAVES)}")
        if not 0.0 <= self.warmup <= 1.0:
            raise LlmaccelError(f"bitlinear.warmup={self.warmup}: expected a fraction in [0, 1]")

    def names(self) -> list[str]:
        return [s.strip() for s in self.linears.split(",") if s.strip()]


def _leaf(lin: torch.fx.Node) -> str:
    """'layers.3.q.weight' -> 'q'."""
    return lin.args[1].target.removesuffix(".weight").rpartition(".")[2]


def _bias_node(lin: torch.fx.Node):
    return lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")


def _group_stem(lins: list[torch.fx.Node]) -> str:
    """[layers.0.q, layers.0.k, layers.0.v] -> 'layers.0.qkv'; one linear keeps its name."""
    stems = [lin.args[1].target.removesuffix(".weight") for lin in lins]
    prefix = stems[0].rpartition(".")[0]
    leaves = [s.rpartition(".")[2] for s in stems]
    joined = "".join(leaves) if all(len(x) == 1 for x in leaves) else "_".join(leaves)
    return f"{prefix}.{joined}" if prefix else joined


def _check_unfused(gm: torch.fx.GraphModule) -> None:
    fused = op_nodes(gm, ops.add_rms_norm, ops.add_layer_norm)
    split = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "split"
             and is_op(n.args[0], ops.linear)]
    folded = [n for n in op_nodes(gm, ops.rms_norm) if n.args[1] is None]
    if fused or split or folded:
        raise LlmaccelError("bitlinear: the graph has been through `fuse` (fused norms or linears); "
                            "run bitlinear before fuse, e.g. --passes bitlinear,fuse")


def _lambda_node(gm: torch.fx.GraphModule, before: torch.fx.Node) -> torch.fx.Node:
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(_LAMBDA)


class Bitlinear(Pass):
    name = "bitlinear"
    before = ("fuse", "quant")  # it converts plain linears
    summary = "BitNet b1.58: ternary weights, int8 activations, RMSNorm fused into the BitLinear op"
    exact = False
    config_cls = BitlinearConfig

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        _check_unfused(gm)
        if op_nodes(gm, *_TRAIN_OPS, bl.bitlinear, bl.rms_norm_bitlinear):
            raise LlmaccelError("bitlinear: the graph already holds BitLinear ops")
        lins = [n for n in op_nodes(gm, ops.linear) if c.linears == "all" or _leaf(n) in c.names()]
        if not lins:
            fam = ctx.config.family if ctx.config is not None else "this"
            raise LlmaccelError(f"bitlinear: the {fam} graph has no linears named "
                                f"{c.linears} to convert (quantized already?)")
        bytes_before = sum(_nbytes(weight_of(gm, n.args[1])) for n in lins)   # biases stay as they are
        orig = snapshot(gm) if c.fit else None
        groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for lin in lins:
            groups.setdefault(lin.args[0], []).append(lin)
        dev = weight_of(gm, lins[0].args[1]).device
        gm.register_buffer(_LAMBDA, torch.ones((), device=dev))
        setattr(gm, _WARMUP, float(c.warmup))
        norms_fused = 0
        for x, group in groups.items():
            norms_fused += self._convert(gm, x, group)
        gm.graph.eliminate_dead_code()   # norms absorbed into their group's op
        stats = {"scale": c.scale, "linears_converted": len(lins), "ops": len(groups),
                 "norms_fused": norms_fused, "weight_bytes_before": bytes_before}
        unfitted = None
        if c.fit:
            gm.graph.lint()
            gm.recompile()
            if c.fit_report_tokens:
                unfitted = _packed_copy(gm)
            stats["fit"] = fit_sites(gm, ctx, c, lambda errs, updates: (
                {n: ternary_fit(gm, n, c.fit_damp, errs, updates) for n in op_nodes(gm, *_TRAIN_OPS)},
                set()), "bitlinear fit", orig)
        if ctx.trained:
            stats["form"] = "training (packed by heal)"
            stats.update(_latent_stats(gm))
            fitted = _packed_copy(gm) if unfitted is not None else None
        else:
            stats["form"] = "packed"
            stats.update(_finish(gm))
            fitted = gm
        prune_weights(gm)
        if unfitted is not None:
            gm.recompile()
            stats["fit"]["quality"] = quality(ctx, {"unfitted": unfitted, "fitted": fitted}, c.fit_report_tokens)
        return PassResult(gm, len(lins), stats)

    def _convert(self, gm: torch.fx.GraphModule, x: torch.fx.Node, group: list[torch.fx.Node]) -> int:
        c, g = self.config, gm.graph
        order = {n: i for i, n in enumerate(g.nodes)}
        group.sort(key=order.__getitem__)
        first = group[0]
        ws = [weight_of(gm, lin.args[1]) for lin in group]
        bs = [weight_of(gm, _bias_node(lin)) for lin in group]
        stem = _group_stem(group)
        w_node = add_weight(gm, stem + ".latent", torch.cat(ws, 0), first)
        b_node = None
        if any(b is not None for b in bs):
            full = [b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(bs, ws)]
            b_node = add_weight(gm, stem + ".bias", torch.cat(full), first)
        lam = _lambda_node(gm, first)
        segments = tuple(int(w.shape[0]) for w in ws)
        kw = {"scale": c.scale, "segments": segments}
        fuse = c.fuse_norm and is_op(x, ops.rms_norm)
        with g.inserting_before(first):
            if fuse:
                kw["eps"] = x.kwargs["eps"]
                out = g.call_function(bl.rms_norm_bitlinear_train,
                                      (x.args[0], x.args[1], w_node, b_node, lam), kw)
            else:
                out = g.call_function(bl.bitlinear_train, (x, w_node, b_node, lam), kw)
            out.meta["fit_input"] = x.name   # the original node of its input, for fitting
            if len(group) == 1:
                first.replace_all_uses_with(out)
            else:
                parts = g.call_method("split", (out, list(segments)), {"dim": -1})
                for i, lin in enumerate(group):
                    lin.replace_all_uses_with(g.call_function(operator.getitem, (parts, i)))
        for lin in group:
            g.erase_node(lin)
        return int(fuse)

    @classmethod
    def training_form(cls, gm: torch.fx.GraphModule) -> TrainingForm:
        return TrainingForm(lambda frac: cls._schedule(gm, frac), lambda: cls._finish(gm))

    @classmethod
    def _schedule(cls, gm: torch.fx.GraphModule, frac: float) -> None:
        lam = getattr(gm, _LAMBDA, None)
        if not isinstance(lam, torch.Tensor):
            return
        warm = float(getattr(gm, _WARMUP, 0.0))
        lam.fill_(1.0 if warm <= 0 else min(1.0, frac / warm))

    @classmethod
    def _finish(cls, gm: torch.fx.GraphModule) -> dict:
        if not op_nodes(gm, *_TRAIN_OPS):
            return {}
        st = _finish(gm)
        prune_weights(gm)
        return {"bitlinear": st}


def _packed_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The inference form of a training-form graph, on a copy (gm unchanged)."""
    out = copy.deepcopy(gm)
    _finish(out)
    prune_weights(out)
    out.graph.lint()
    out.recompile()
    return out


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _latent_stats(gm: torch.fx.GraphModule) -> dict:
    """Relative reconstruction error of the ternary weights, ||W - s T|| / ||W||, over all ops."""
    err = ref = 0.0
    for n in op_nodes(gm, *_TRAIN_OPS):
        w_i = 1 if n.target is bl.bitlinear_train else 2
        w = weight_of(gm, n.args[w_i]).float()
        t, s = bl.ternarize(w, n.kwargs["scale"], n.kwargs["segments"])
        err += (w - t * s[:, None]).pow(2).sum().item()
        ref += w.pow(2).sum().item()
    return {"weight_rel_error": round((err / ref) ** 0.5, 4)}


def _finish(gm: torch.fx.GraphModule) -> dict:
    """Training form -> packed inference form, in place. Stats of what was packed."""
    stats = _latent_stats(gm)
    g = gm.graph
    packed_bytes = n_weights = zeros = 0
    for n in op_nodes(gm, *_TRAIN_OPS):
        fused = n.target is bl.rms_norm_bitlinear_train
        w_node = n.args[2 if fused else 1]
        w = weight_of(gm, w_node)
        t, s = bl.ternarize(w, n.kwargs["scale"], n.kwargs["segments"])
        stem = w_node.target.removesuffix(".latent")
        wp = add_weight(gm, stem + ".w_packed", bl.pack_ternary(t), n)
        ws = add_weight(gm, stem + ".w_scale", s.to(w.dtype), n)
        packed_bytes += _nbytes(weight_of(gm, wp), weight_of(gm, ws))
        n_weights += t.numel()
        zeros += int((t == 0).sum())
        kw = {"in_features": int(w.shape[1]), "out_features": int(w.shape[0])}
        if fused:
            x, norm_w, _, bias, _ = n.args
            args, target = (x, norm_w, wp, ws, bias), bl.rms_norm_bitlinear
            kw = {"eps": n.kwargs["eps"], **kw}
        else:
            x, _, bias, _ = n.args
            args, target = (x, wp, ws, bias), bl.bitlinear
        with g.inserting_before(n):
            new = g.call_function(target, args, kw)
        n.replace_all_uses_with(new)
        g.erase_node(n)
    g.eliminate_dead_code()
    if _LAMBDA in gm._buffers:
        del gm._buffers[_LAMBDA]
    if hasattr(gm, _WARMUP):
        delattr(gm, _WARMUP)
    stats.update({"weight_bytes_after": packed_bytes,
                  "bits_per_weight": round(8 * packed_bytes / max(n_weights, 1), 3),
                  "zero_fraction": round(zeros / max(n_weights, 1), 4)})
    return stats


PASS = Bitlinear
