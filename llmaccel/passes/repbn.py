"""repbn: RMSNorm/LayerNorm -> BatchNorm calibrated on text, folded into the linears (SLAB PRepBN).

A BatchNorm with fixed statistics is a per-channel affine map, BN(x) = a * x + c with
a = gamma / sqrt(var + eps) and c = beta - mean * a, so once it replaces a norm it folds into
every linear that reads it (W' = W diag(a), b' = W c + b) and no normalization op is left.

Statistics (per-channel mean and variance over all tokens) come from one forward of the whole
calibration batch. With `repbn.stats=sequential` (default) every norm is already a BN during that
forward, so each layer's statistics describe the inputs it will see at inference, with the BNs
of earlier layers in place; `source` takes them from the unmodified model instead. gamma starts
as the norm's weight and beta as its bias (0 for RMSNorm).

When `heal` follows, the pass emits the training form instead: `repbn_blend` =
lam * Norm(x) + (1 - lam) * BN(x) with lam a 0-dim buffer (never trained) moved by the heal
schedule lam = max(0, 1 - frac / repbn.ramp): the source model at the first step, pure BN for
the last (1 - ramp) of the steps. heal trains gamma, beta and the norm weights; the BN statistics
stay as calibrated (so the trained BN is exactly the BN that is folded). Finishing the
training form then folds the blend exactly as the path without heal does.

A norm read by anything but a linear's input (a quantized linear, a residual) keeps a cheap
`norm_affine` op; a tied LM head is untied so that it can take the final norm's scale.

`repbn.clamp` (default 1) clamps the BN's input per channel to its calibrated range: on a
pretrained model a token far outside that range is no longer scaled back per token and grows
through the gated MLPs until it overflows (2 of 16 held-out windows of SmolLM2-135M). The
clamp is elementwise, reads two vectors and stays in the graph in front of the folded linears;
in the training form only the BN branch is clamped, so lam = 1 stays exactly the source model.
`repbn.clamp=0` is the pure form.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx
import torch.nn as nn

from llmaccel import ops
from llmaccel.ir import op_counts
from llmaccel.errors import LlmaccelError
from llmaccel.ops import repbn as rops
from llmaccel.passes.base import Pass, PassContext, PassResult, TrainingForm
from llmaccel.passes.fitting import FitOptions, fit_sites, quality, snapshot
from llmaccel.ir import (add_weight, fold_affine, fresh_name, is_op, op_nodes, positions, prune_weights,
                         replace_weight, weight_of)

_NORMS = (ops.rms_norm, ops.layer_norm)
_FUSED = (ops.add_rms_norm, ops.add_layer_norm)
_ANY_NORM = (*_NORMS, *_FUSED, rops.repbn_blend, rops.batch_norm, rops.norm_affine)
_DEFAULT_RAMP = 0.8  # used when a blend node lost its meta (e.g. read back from an artifact)


@dataclass
class RepBNConfig(FitOptions):
    samples: int = 32        # calibration windows, run as one batch (memory grows with both)
    seq_len: int = 256
    stats: Literal["sequential", "source"] = "sequential"
    ramp: float = 0.8        # heal: fraction of the steps over which lam goes from 1 to 0
    # >= 1: clamp each norm input, per channel, to its calibrated [min, max] range widened
    # `clamp` times about its midpoint (elementwise, no reduction; see _clamp_bounds); 0 = off,
    # the pure BN form, whose rare out-of-range tokens overflow to inf on SmolLM2-135M
    clamp: float = 1.0
    time_reps: int = 5       # timed forwards before/after (median); 0 skips timing
    time_tokens: int = 128   # tokens of the timed forward (batch 1)
    fit_shift: bool = True   # fit: a per-channel shift besides the scale (false: scale only)
    # fitted on calibration text alone, the folded affines learned wikitext's activations and got
    # worse on code and docs; with half the windows the source's own continuations of varied
    # openings, every domain improved (SmolLM2-135M, docs/quality.md)
    fit_data: Literal["calib", "mixed"] = "mixed"

    def __post_init__(self):
        super().__post_init__()
        if self.samples < 1 or self.seq_len < 2:
            raise LlmaccelError("repbn.samples must be >= 1 and repbn.seq_len >= 2")
        if self.clamp != 0 and self.clamp < 1:
            raise LlmaccelError(f"repbn.clamp must be 0 (off) or >= 1, got {self.clamp}")
        if not 0.0 <= self.ramp <= 1.0:
            raise LlmaccelError(f"repbn.ramp must be in [0, 1], got {self.ramp}")
        if self.time_reps < 0 or self.time_tokens < 1:
            raise LlmaccelError("repbn.time_reps must be >= 0 and repbn.time_tokens >= 1")


def _norm_args(n: torch.fx.Node):
    """(x, weight node, bias node, kind) of an rms_norm / layer_norm node."""
    if n.target is ops.layer_norm:
        return n.args[0], n.args[1], n.args[2], "layer"
    return n.args[0], n.args[1], None, "rms"


class _Calibrate(torch.fx.Interpreter):
    """One forward recording, for every norm, the mean and variance of its input per channel."""

    def __init__(self, gm: torch.fx.GraphModule, sequential: bool):
        super().__init__(gm)
        self.sequential = sequential
        self.stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def run_node(self, n: torch.fx.Node):
        if is_op(n, ops.lm_head):
            return None  # the logits are not needed and are the largest tensor
        if not is_op(n, *_NORMS):
            return super().run_node(n)
        args, _ = self.fetch_args_kwargs_from_env(n)
        x = args[0]
        h = x.detach().flatten(0, -2).double()
        var, mean = torch.var_mean(h, 0, correction=0)
        self.stats[n.name] = (mean.float(), var.float())
        self.ranges[n.name] = (h.amin(0), h.amax(0))
        if not self.sequential:
            return super().run_node(n)
        bias = args[2] if n.target is ops.layer_norm else None
        return rops.batch_norm(x, mean, var, args[1], bias, eps=n.kwargs["eps"])


def _add_buffer(gm: torch.fx.GraphModule, base: str, value: torch.Tensor, before: torch.fx.Node) -> torch.fx.Node:
    """Like ir.add_weight but a buffer: heal trains Parameters only, and these must stay fixed."""
    name = fresh_name(gm, base)
    *path, leaf = name.split(".")
    mod = gm
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    mod.register_buffer(leaf, value)
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(name)


def _to_blend(gm, norm: torch.fx.Node, mean, var, ramp: float, dtype: torch.dtype,
              bounds: tuple = ()) -> torch.fx.Node:
    x, w_node, b_node, kind = _norm_args(norm)
    w, b = weight_of(gm, w_node), weight_of(gm, b_node)
    base = w_node.target.removesuffix(".weight") if w_node is not None else f"repbn.{norm.name}"
    D = mean.shape[0]
    gamma = w.detach().clone() if w is not None else torch.ones(D, dtype=dtype, device=mean.device)
    beta = b.detach().clone() if b is not None else torch.zeros(D, dtype=gamma.dtype, device=mean.device)
    m_node = _add_buffer(gm, base + ".bn_mean", mean, norm)
    v_node = _add_buffer(gm, base + ".bn_var", var, norm)
    g_node = add_weight(gm, base + ".bn_weight", gamma, norm)
    be_node = add_weight(gm, base + ".bn_bias", beta, norm)
    lam_node = _add_buffer(gm, base + ".lam", torch.zeros((), device=mean.device), norm)
    with gm.graph.inserting_before(norm):
        blend = gm.graph.call_function(rops.repbn_blend, (x, w_node, b_node, m_node, v_node, g_node,
                                                          be_node, lam_node, *bounds),
                                       {"kind": kind, "eps": norm.kwargs["eps"]})
    blend.meta["repbn_ramp"] = ramp
    blend.meta["repbn_norm"] = norm.name   # the original node, for fitting to the source
    norm.replace_all_uses_with(blend)
    gm.graph.erase_node(norm)
    return blend


def _clamp_bounds(gm, norm: torch.fx.Node, lo, hi, k: float, dtype: torch.dtype) -> tuple:
    """get_attr nodes of the BN input's clamp range: the calibrated range widened k times.

    Without a per-token norm, a token far outside the calibration distribution is not scaled
    back, and the gated MLP squares it layer after layer until it overflows; the clamp bounds
    what each layer can pass on. Tokens inside the calibrated range are unchanged, so the
    statistics measured without the clamp stay exact for the calibration data.
    """
    mid, half = (lo + hi) / 2, (hi - lo) / 2 * k
    base = norm.args[1].target.removesuffix(".weight") if norm.args[1] is not None else f"repbn.{norm.name}"
    return (_add_buffer(gm, base + ".clamp_lo", (mid - half).to(dtype), norm),
            _add_buffer(gm, base + ".clamp_hi", (mid + half).to(dtype), norm))


def _absorbs(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """A linear (or the LM head) that reads `node` as its input and nowhere else."""
    return (is_op(user, ops.linear, ops.lm_head) and user.args[0] is node
            and node not in user.args[1:] and node not in user.kwargs.values())


def _fold_into(gm, lin: torch.fx.Node, x: torch.fx.Node, a: torch.Tensor, c: torch.Tensor, st: dict) -> None:
    """lin(a * x + c) -> lin'(x): W' = W diag(a), b' = W c + b."""
    # A head tied to the embedding cannot take the scale: it gets its own copy.
    own = "lm_head.weight" if lin.target is ops.lm_head else None
    flags = fold_affine(gm, lin, a, c, own_weight=own)
    lin.args = (x, *lin.args[1:])
    if flags["untied"]:
        st["lm_head_untied"] = True
    st["linears_biased"] += flags["biased"]
    st["linears_folded"] += 1


def fold(gm: torch.fx.GraphModule) -> dict:
    """Replace every repbn_blend by its BN (lam = 0) folded into the linears that read it."""
    st = {"norms_folded": 0, "affine_kept": 0, "clamps_kept": 0, "linears_folded": 0, "linears_biased": 0,
          "lm_head_untied": False, "affine_readers": []}
    for node in op_nodes(gm, rops.repbn_blend):
        x, _, _, m_node, v_node, g_node, be_node, _ = node.args[:8]
        if len(node.args) > 8 and node.args[8] is not None:
            with gm.graph.inserting_before(node):
                x = gm.graph.call_function(torch.clamp, (x, *node.args[8:10]))
            st["clamps_kept"] += 1
        eps = node.kwargs["eps"]
        mean, var = weight_of(gm, m_node).double(), weight_of(gm, v_node).double()
        g, beta = weight_of(gm, g_node), weight_of(gm, be_node)
        a = torch.rsqrt(var + eps) * (g.detach().double() if g is not None else 1.0)
        c = (beta.detach().double() if beta is not None else 0.0) - mean * a
        users = list(node.users)
        if users and all(_absorbs(u, node) for u in users):
            for u in users:
                _fold_into(gm, u, x, a, c, st)
            st["norms_folded"] += 1
        else:
            s_node = add_weight(gm, m_node.target.removesuffix("bn_mean") + "scale", a.float(), node)
            t_node = add_weight(gm, m_node.target.removesuffix("bn_mean") + "shift", c.float(), node)
            with gm.graph.inserting_before(node):
                aff = gm.graph.call_function(rops.norm_affine, (x, s_node, t_node))
            node.replace_all_uses_with(aff)
            st["affine_kept"] += 1
            st["affine_readers"] += sorted({u.name for u in users if not _absorbs(u, node)})
        gm.graph.erase_node(node)
    prune_weights(gm)
    if not st["affine_readers"]:
        del st["affine_readers"]
    return st


def _reader_metric(gm, node: torch.fx.Node, D: int) -> torch.Tensor:
    """M = Σ WᵀW over the linears that read `node` (identity for any other reader): the norm's
    output error e costs eᵀMe in what its readers compute."""
    M = torch.zeros(D, D, dtype=torch.float64)
    other = False
    for u in node.users:
        if _absorbs(u, node):
            w = weight_of(gm, u.args[1]).detach()
            M += (w.T.double() @ w.double()).cpu()
        else:
            other = True
    if other or not M.any():
        M += torch.eye(D, dtype=torch.float64) * max(M.diagonal().mean().item(), 1.0)
    return M


def solve_affine(x: torch.Tensor, y: torch.Tensor, M: torch.Tensor, a0: torch.Tensor,
                 c0: torch.Tensor, damp: float, shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel a, c minimising Σ_t (x_t∘a + c - y_t)ᵀ M (x_t∘a + c - y_t) + λ||(a, c) - (a0, c0)||²
    over tokens x, y (N, D): the 2D normal equations, written with Hadamard products
    (Σ_t diag(x_t) M diag(x_t) = M ∘ XᵀX). float64. shift=False: c = 0 (a scale only, as an
    RMSNorm has no shift)."""
    N, D = x.shape
    if not shift:
        A = M * (x.T @ x)
        lam = damp * A.diagonal().mean() + 1e-12
        A.diagonal().add_(lam)
        return torch.linalg.solve(A, (M * (x.T @ y)).sum(1) + lam * a0), torch.zeros_like(c0)
    sx, sy = x.sum(0), y.sum(0)
    A = torch.empty(2 * D, 2 * D, dtype=torch.float64)
    A[:D, :D] = M * (x.T @ x)
    A[:D, D:] = M * sx[:, None]
    A[D:, :D] = A[:D, D:].T
    A[D:, D:] = N * M
    b = torch.cat([(M * (x.T @ y)).sum(1), M @ sy])
    lam = damp * A.diagonal().mean() + 1e-12
    A.diagonal().add_(lam)
    sol = torch.linalg.solve(A, b + lam * torch.cat([a0, c0]))
    return sol[:D], sol[D:]


def _affine_fit(gm, damp: float, shift: bool, errs: list, updates: list):
    """Fit callback of one repbn_blend (at lam = 0, the BN): its folded affine a·x + c fitted to
    the norm's outputs on the inputs at hand, in the metric of the norm's readers; written back
    as the BN's gamma and beta (the calibrated statistics stay)."""
    def site(interp, n):
        args = [interp.value(a) if isinstance(a, torch.fx.Node) else a for a in n.args]
        x, nw, nb, mean, var, g, beta = args[:7]
        lo, hi = (args[8], args[9]) if len(args) > 9 else (None, None)
        eps = n.kwargs["eps"]
        D = x.shape[-1]
        h = x.detach().reshape(-1, D).double().cpu()
        xb = h if lo is None else torch.clamp(h, lo.double().cpu(), hi.double().cpu())
        if interp.source is not None:
            norm = interp.source.value(n.meta["repbn_norm"])
        elif n.kwargs["kind"] == "rms":
            norm = ops.rms_norm(x, nw, eps=eps)
        else:
            norm = ops.layer_norm(x, nw, nb, eps=eps)
        y = norm.reshape(-1, D).double().cpu()
        M = _reader_metric(gm, n, D)
        mean, var = mean.double().cpu(), var.double().cpu()
        a0 = torch.rsqrt(var + eps) * g.double().cpu()
        c0 = beta.double().cpu() - mean * a0
        a, c_ = solve_affine(xb, y, M, a0, c0, damp, shift)

        def err(a, c_):
            r = xb * a + c_ - y
            return ((r @ M) * r).sum().item() / max(((y @ M) * y).sum().item(), 1e-30)
        before, after = err(a0, c0), err(a, c_)
        errs.append((before, min(before, after)))
        if after >= before:
            return super(type(interp), interp).run_node(n)
        dev, dt = g.device, g.dtype
        g_new = (a * torch.sqrt(var + eps)).to(dev, dt)
        b_new = (c_ + mean * a).to(dev, dt)

        def write():
            n.update_arg(5, replace_weight(gm, n.args[5], g_new, n))
            n.update_arg(6, replace_weight(gm, n.args[6], b_new, n))
        updates.append(write)
        return rops.repbn_blend(x, nw, nb, args[3], args[4], g_new, b_new, *args[7:], **n.kwargs)
    return site


@torch.no_grad()
def forward_ms(gm: torch.fx.GraphModule, vocab: int, tokens: int, reps: int, device) -> float:
    """Median wall time of a batch-1 forward of `tokens` fixed tokens, after one warm-up."""
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    pos = torch.arange(tokens, device=ids.device)[None]
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    gm(ids, pos, None)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        gm(ids, pos, None)
        sync()
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 3)


def _ops(gm) -> tuple[int, int]:
    """(IR + glue op nodes, normalization-like op nodes)."""
    c = op_counts(gm)
    norm_names = {f.__name__ for f in _ANY_NORM}
    return sum(c.values()), sum(v for k, v in c.items() if k in norm_names)


class RepBN(Pass):
    name = "repbn"
    summary = "RMSNorm/LayerNorm -> text-calibrated BatchNorm folded into the linears (SLAB PRepBN)"
    exact = False
    config_cls = RepBNConfig

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        if op_nodes(gm, *_FUSED):
            raise LlmaccelError("repbn: the graph has fused residual-add norms (add_rms_norm/"
                                "add_layer_norm); run repbn before fuse")
        norms = op_nodes(gm, *_NORMS)
        if not norms:
            raise LlmaccelError("repbn: the graph has no RMSNorm or LayerNorm to replace")
        vocab = ctx.config.vocab_size
        time_it = (lambda g: forward_ms(g, vocab, c.time_tokens, c.time_reps, ctx.device)) if c.time_reps else None
        ops_before, norm_ops_before = _ops(gm)
        ms_before = time_it(gm) if time_it else None
        ids = ctx.calib_tokens(c.samples, c.seq_len).to(ctx.device)
        cal = _Calibrate(gm, c.stats == "sequential")
        with torch.no_grad():
            cal.run(ids, positions(ids), None)
        dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), torch.float32)
        orig = snapshot(gm) if c.fit else None
        for n in norms:
            bounds = _clamp_bounds(gm, n, *cal.ranges[n.name], c.clamp, dtype) if c.clamp else ()
            _to_blend(gm, n, *cal.stats[n.name], ramp=c.ramp, dtype=dtype, bounds=bounds)
        gm.graph.lint()
        gm.recompile()
        fit_st, unfitted = None, None
        if c.fit:
            if c.fit_report_tokens:
                unfitted = copy.deepcopy(gm)
                fold(unfitted)
                unfitted.graph.lint()
                unfitted.recompile()
            fit_st = fit_sites(gm, ctx, c, lambda errs, updates: (
                {n: _affine_fit(gm, c.fit_damp, c.fit_shift, errs, updates) for n in op_nodes(gm, rops.repbn_blend)},
                set()), "repbn fit", orig)
        training = ctx.trained
        # The inference form is what ships either way: in the training form it is previewed
        # on a copy so that the figures below describe the model heal will finish into.
        target = copy.deepcopy(gm) if training else gm
        st = fold(target)
        target.graph.lint()
        target.recompile()
        ops_after, norm_ops_after = _ops(target)
        stats = {"form": "training (repbn_blend, folded by heal)" if training else "inference",
                 "norms_replaced": len(norms), "norms_removed": st["norms_folded"],
                 **{k: v for k, v in st.items() if k != "norms_folded"},
                 "stats": c.stats, "calib_tokens": int(ids.numel()),
                 "ops_before": ops_before, "ops_after": ops_after,
                 "norm_ops_before": norm_ops_before, "norm_ops_after": norm_ops_after}
        if time_it:
            stats.update(forward_tokens=c.time_tokens, forward_ms_before=ms_before,
                         forward_ms_after=time_it(target))
        if training:
            stats["ramp"] = c.ramp
        if fit_st is not None:
            if unfitted is not None:
                fit_st["quality"] = quality(ctx, {"unfitted": unfitted, "fitted": target}, c.fit_report_tokens)
            stats["fit"] = fit_st
        return PassResult(gm, len(norms), stats)

    @classmethod
    def training_form(cls, gm: torch.fx.GraphModule) -> TrainingForm:
        return TrainingForm(lambda frac: cls._schedule(gm, frac), lambda: cls._finish(gm))

    @classmethod
    def _schedule(cls, gm: torch.fx.GraphModule, frac: float) -> None:
        for n in op_nodes(gm, rops.repbn_blend):
            ramp = n.meta.get("repbn_ramp", _DEFAULT_RAMP)
            lam = 0.0 if ramp <= 0 else max(0.0, 1.0 - frac / ramp)
            weight_of(gm, n.args[7]).fill_(lam)

    @classmethod
    def _finish(cls, gm: torch.fx.GraphModule) -> dict:
        if not op_nodes(gm, rops.repbn_blend):
            return {}
        st = fold(gm)
        gm.graph.lint()
        gm.recompile()
        return {f"repbn_{k}": v for k, v in st.items()}


PASS = RepBN
