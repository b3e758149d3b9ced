"""Layer-local fitting shared by the approximate passes (gqa, sla, repbn, bitlinear, relu): not a pass.

After a pass has made its replacement (its closed-form initialisation), `PASS.fit=true` fits the
new parameters of every replaced module so that it reproduces the original module's outputs,
layer by layer, with no backprop through the network:

- the graph runs once over the calibration batch, node by node (an fx Interpreter); when a
  replaced module's output node is reached, its inputs are the values the already-fitted layers
  before it produce (GPTQ's "sequential" order), the pass's fit callback fits the module on them
  against the original module's output on the same inputs, and the run goes on with the fitted
  module's output;
- each fit is closed-form or a GPTQ-style solve (least squares in the metric of the readers),
  except gqa's q/k/v projections, which a few hundred Adam steps on the one layer fit
  (passes/gqa_fit.py); a 135M model fits in one to five minutes on a CPU.

With `PASS.fit_report_tokens > 0` the pass's stats also hold the model's quality before and after
fitting on every evaluation domain (llmaccel/eval/domains.py: wikitext2's second half and texts
of other domains that no calibration ever reads).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable, Literal

import operator

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.eval.domains import compare, domain_tokens, graph_forward, text_encoder
from llmaccel.ir import is_op, positions, replace_weight, weight_of
from llmaccel.passes.sampled import PROMPT_TOKENS, sample_source


@dataclass
class FitOptions:
    """Options every fitting pass shares (`--set PASS.fit=true` ...)."""
    fit: bool = False            # layer-local fitting of the replaced modules (module docstring)
    # what a module is fitted to: `source`, the original model's output at that module on the
    # same text (so a module also absorbs the drift of the fitted layers before it); `local`,
    # the original module's output on the inputs the fitted layers before it produce
    fit_target: Literal["source", "local"] = "source"
    fit_samples: int = 16        # calibration windows the fit runs on (one batch)
    fit_seq_len: int = 256
    # ridge of repbn's and bitlinear's least-squares fits, relative to the mean diagonal; gqa, sla
    # and relu choose theirs on held-out tokens (ridge_refit_validated) and do not read it
    fit_damp: float = 0.01
    fit_report_tokens: int = 2048  # tokens per domain of the before/after report (0: none)
    # the fit's text: `calib`, calibration windows only; `mixed`, half of them replaced by the
    # source model's own continuations of varied openings (code, dialogue, docs: heal's prompts)
    fit_data: Literal["calib", "mixed"] = "calib"

    def __post_init__(self):
        # two windows at least: the fits hold windows out to choose on, and fit_data=mixed
        # samples half of them
        if self.fit_samples < 2 or self.fit_seq_len < 2:
            raise LlmaccelError(f"fit_samples and fit_seq_len must be >= 2, got {self.fit_samples} and "
                                f"{self.fit_seq_len}")
        if not 0 <= self.fit_damp < 1:
            raise LlmaccelError(f"fit_damp must be in [0, 1), got {self.fit_damp}")
        if self.fit_report_tokens < 0:
            raise LlmaccelError(f"fit_report_tokens must not be negative, got {self.fit_report_tokens}")


def snapshot(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph as it is now, sharing today's weight tensors: rewrites that install new tensors
    (ir.replace_weight, set_weight) leave the snapshot as it was. No weight is copied."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name="snapshot")


def subgraph(gm: torch.fx.GraphModule, inputs: list[str], output: str) -> torch.fx.GraphModule:
    """A module sharing gm's weights that computes node `output` from the nodes named `inputs`
    (its arguments, in order). Any other placeholder it needs (the attention context) is None:
    a whole-sequence forward without a cache."""
    by_name = {n.name: n for n in gm.graph.nodes}
    missing = [n for n in (*inputs, output) if n not in by_name]
    if missing:
        raise LlmaccelError(f"fit: nodes {missing} are not in the graph")
    stop = {by_name[n] for n in inputs}
    need, todo = set(), [by_name[output]]
    while todo:
        n = todo.pop()
        if n in need:
            continue
        need.add(n)
        if n not in stop:
            todo.extend(n.all_input_nodes)
    g = torch.fx.Graph()
    env = {by_name[name]: g.placeholder(name) for name in inputs}
    for n in gm.graph.nodes:
        if n in need and n not in env:
            env[n] = None if n.op == "placeholder" else g.node_copy(n, lambda a: env[a])
    g.output(env[by_name[output]])
    return torch.fx.GraphModule(gm, g, class_name="fit_subgraph")


class Source:
    """The original graph run over the same batch, lazily: `value(name)` advances it node by node
    until that node is computed (sites ask in graph order), freeing values as fx does."""

    def __init__(self, gm: torch.fx.GraphModule, args: tuple):
        self.interp = torch.fx.Interpreter(gm)
        self.interp.env, self.interp.args_iter = {}, iter(args)
        self.nodes = iter(gm.graph.nodes)
        self.seen: dict = {}

    def value(self, name: str) -> torch.Tensor:
        it = self.interp
        while name not in self.seen:
            n = next(self.nodes, None)
            if n is None or n.op == "output":
                raise LlmaccelError(f"fit: the original graph has no node {name}")
            it.env[n] = it.run_node(n)
            self.seen[n.name] = it.env[n]
            for dead in it.user_to_last_uses.get(n, []):
                it.env.pop(dead, None)
                self.seen.pop(dead.name, None)
        return self.seen.pop(name)


class _Sequential(torch.fx.Interpreter):
    """Runs gm on the calibration batch; at a site node its callback returns the node's value
    (after fitting the module that ends there). Values of `keep` nodes stay available in
    `kept` for later sites. Nodes after the last site are skipped (the logits are not needed)."""

    def __init__(self, gm, sites: dict, keep: set, bar, source: Source | None):
        super().__init__(gm)
        self.sites, self.pending, self.keep, self.bar = sites, set(sites), keep, bar
        self.kept: dict = {}
        self.source = source   # the original graph on the same batch (fit_target=source)

    def run_node(self, n):
        if not self.pending:
            return None
        if n in self.sites:
            val = self.sites[n](self, n)
            self.pending.discard(n)
            self.bar.update(1)
        else:
            val = super().run_node(n)
        if n in self.keep:
            self.kept[n] = val
        return val

    def value(self, n: torch.fx.Node):
        return self.kept[n] if n in self.kept else self.env[n]


def run_sequential(gm: torch.fx.GraphModule, ids: torch.Tensor, sites: dict[torch.fx.Node, Callable],
                   keep: set, progress, desc: str, orig: torch.fx.GraphModule | None = None) -> float:
    """One node-by-node run of gm over ids (B, T), fitting at each site; with `orig`, the
    original graph runs alongside (Source). Returns seconds."""
    t0 = time.perf_counter()
    bar = progress(None, desc=desc, total=len(sites))
    args = (ids, positions(ids), None)
    with torch.no_grad():
        _Sequential(gm, sites, keep, bar, Source(orig, args) if orig is not None else None).run(*args)
    bar.close()
    return time.perf_counter() - t0


def fit_windows(ctx, c: FitOptions) -> torch.Tensor:
    """The fit's token windows (c.fit_data)."""
    ids = ctx.calib_tokens(c.fit_samples, c.fit_seq_len)
    if c.fit_data == "mixed":
        n = len(ids) // 2  # half the prompts from these windows, half built-in openings
        sampled, _ = sample_source(ctx, ids, n, c.fit_seq_len, "mixed",
                                   prompt_len=min(PROMPT_TOKENS, c.fit_seq_len // 2), seed=0,
                                   max_seqs=max(1, n), who="fit_data=mixed", calib_share=0.5)
        # interleaved: the fits choose on held-out rows (the second half of the tokens, the last
        # windows), which must hold both kinds of text, not the sampled ones alone
        calib = ids[: len(ids) - n].cpu()
        ids = torch.stack([w for pair in zip(calib, sampled.cpu()) for w in pair] + list(calib[n:]))
    return ids.to(ctx.device)


def fit_sites(gm: torch.fx.GraphModule, ctx, c: FitOptions, make_sites, desc: str,
              orig: torch.fx.GraphModule) -> dict:
    """Run the sequential fit: make_sites(errs, updates) -> (sites, keep); each site callback
    appends (error before, error after) to errs and the weight rewrites to apply to updates
    (applied after the run: the graph is not changed while the interpreter walks it)."""
    ids = fit_windows(ctx, c)
    errs: list[tuple[float, float]] = []
    updates: list[Callable[[], None]] = []
    sites, keep = make_sites(errs, updates)
    seconds = run_sequential(gm, ids, sites, keep, ctx.progress, desc,
                             orig if c.fit_target == "source" else None)
    for u in updates:
        u()
    gm.graph.lint()
    gm.recompile()
    return fit_stats(errs, seconds, ids)


def _attention_input(att: torch.fx.Node) -> torch.fx.Node:
    """The node the attention's q projection reads (through RoPE and a fused split)."""
    q = att.args[0]
    if is_op(q, ops.rope):
        q = q.args[0]
    if is_op(q, operator.getitem):
        q = q.args[0].args[0]   # getitem(split(linear))
    if not is_op(q, ops.linear):
        raise LlmaccelError(f"fit: layer {att.kwargs['layer']}'s q is not a float linear")
    return q.args[0]


def attention_sites(gm: torch.fx.GraphModule, orig: torch.fx.GraphModule, atts: list[torch.fx.Node],
                    prefit: Callable | None = None):
    """make_sites for passes that replace attention (gqa, sla): at each attention's output
    linear W_o, refit W_o by least squares so that W_o(new attention(x)) matches the original
    W_o(softmax attention(x)) (fit_target=local; with `source`, the original model's W_o output on
    the same text). W_o is the map from the new attention's heads back to the residual stream,
    so this fits the merged values' read-out (gqa) or the linear attention's gain (sla, a full
    matrix here) to the attention block's outputs; its ridge is chosen on held-out tokens
    (ridge_refit_validated). `prefit(att, x, pos, y, W_o, b_o)`, if given, first fits the attention's
    own parameters to the same target (gqa's K/V) and returns None (nothing changed) or (the new
    attention output, the W_o to start the refit from, the rewrite that installs them)."""
    pos = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    orig_nodes = {n.name: n for n in orig.graph.nodes}

    def make(errs, updates):
        sites, keep = {}, {pos}
        for att in atts:
            users = list(att.users)
            if len(users) != 1 or not is_op(users[0], ops.linear) or users[0].args[0] is not att:
                continue   # no plain output linear to refit (e.g. quantized): left as it is
            x, o = _attention_input(att), users[0]
            keep.add(x)
            sub = subgraph(orig, [x.name, pos.name], att.name)
            o0 = orig_nodes[o.name]
            w0 = weight_of(orig, o0.args[1])
            b0 = weight_of(orig, o0.args[2] if len(o0.args) > 2 else None)
            pre = None if prefit is None else (lambda *a, att=att: prefit(att, *a))
            sites[o] = _o_refit(gm, sub, w0, b0, x, pos, errs, updates, pre)
        return sites, keep
    return make


def _o_refit(gm, sub, w0, b0, x, pos, errs, updates, prefit=None):
    def site(interp, o):
        z = interp.value(o.args[0])
        if interp.source is not None:
            y = interp.source.value(o.name).float()
        else:
            y = F.linear(sub(interp.value(x), interp.value(pos)), w0, b0).float()
        w = weight_of(gm, o.args[1])
        b = weight_of(gm, o.args[2] if len(o.args) > 2 else None)
        old = F.linear(z, w, b)
        w_start, pre_write = w, None
        if prefit is not None:
            got = prefit(interp.value(x), interp.value(pos), y, w, b)
            if got is not None:
                z, w_start, pre_write = got
        interp.kept.pop(x, None)   # read by this site only
        target = y - (0 if b is None else b.float())
        new_w = ridge_refit_validated(w_start, z.flatten(0, -2).float(), target.flatten(0, -2))
        new = F.linear(z, new_w, b)
        before, after = rel_err(old, y), rel_err(new, y)
        errs.append((before, min(before, after)))
        if after >= before:
            return old

        def write():
            o.args = (o.args[0], replace_weight(gm, o.args[1], new_w, o), *o.args[2:])
        updates.extend([write] if pre_write is None else [pre_write, write])
        return new.to(old.dtype)
    return site


def ridge_refit(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, damp: float) -> torch.Tensor:
    """W' = argmin ||y - x W'ᵀ||² + λ||W' - W||², λ = damp × mean diagonal of xᵀx: the linear that
    best maps the inputs at hand to the targets; the ridge keeps directions the calibration
    tokens barely excite at their current weights. x (N, K), y (N, M), w (M, K)."""
    x, y = x.double(), y.double()
    return _ridge_solve(w, x.T @ x, x.T @ y, damp)


def _ridge_solve(w: torch.Tensor, H: torch.Tensor, G: torch.Tensor, damp: float) -> torch.Tensor:
    """ridge_refit from the Gram matrices H = xᵀx, G = xᵀy (fp64)."""
    H = H.clone()
    lam = damp * H.diagonal().mean() + 1e-12
    H.diagonal().add_(lam)
    return torch.linalg.solve(H, G + lam * w.double().T).T.to(w.dtype)


_DAMPS = (0.01, 0.1, 1.0, 10.0, 100.0)


def ridge_refit_validated(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ridge_refit with its damping chosen on held-out tokens: fitted on the first half of the
    rows for each damping of _DAMPS, scored on the second half; the best is refitted on all rows.
    If no damping beats w itself on the held-out half, w is returned: a linear with as many
    weights as the calibration has tokens overfits them otherwise. The Gram matrices of both
    halves are formed once and the held-out errors computed from them."""
    half = x.shape[0] // 2
    x, y = x.double(), y.double()
    xa, ya, xb, yb = x[:half], y[:half], x[half:], y[half:]
    Ha, Ga, Hb, Gb = xa.T @ xa, xa.T @ ya, xb.T @ xb, xb.T @ yb
    yy = yb.pow(2).sum().clamp_min(1e-30)

    def heldout(wt: torch.Tensor) -> float:   # ||xb Wᵀ - yb||² / ||yb||² through Hb, Gb
        wd = wt.double()
        return ((torch.einsum("mk,kl,ml->", wd, Hb, wd) - 2 * torch.einsum("mk,km->", wd, Gb) + yy) / yy).item()

    best, best_err = None, heldout(w)
    for d in _DAMPS:
        err = heldout(_ridge_solve(w, Ha, Ga, d))
        if err < best_err:
            best, best_err = d, err
    return w if best is None else _ridge_solve(w, Ha + Hb, Ga + Gb, best)


def rel_err(out: torch.Tensor, target: torch.Tensor) -> float:
    """||out - target||² / ||target||²."""
    t = target.double()
    return ((out.double() - t).pow(2).sum() / t.pow(2).sum().clamp_min(1e-30)).item()


def quality(ctx, graphs: dict[str, torch.fx.GraphModule], tokens: int) -> dict | str:
    """ΔPPL, KL and top-1 of each graph against the source on every evaluation domain, or why
    it was skipped."""
    src = ctx.source_model
    if src is None or getattr(src, "tokenizer_dir", None) is None:
        return "skipped: the source model has no tokenizer (a preset); no domain text to score"
    t0 = time.perf_counter()
    toks = domain_tokens(text_encoder(src), tokens)
    res = compare(graph_forward(src.gm), {k: graph_forward(g) for k, g in graphs.items()}, toks,
                  device=ctx.device)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def fit_stats(errs: list[tuple[float, float]], seconds: float, ids: torch.Tensor) -> dict:
    """Mean relative output error of the fitted modules before and after fitting."""
    n = max(1, len(errs))
    return {"modules": len(errs), "calib_tokens": int(ids.numel()), "seconds": round(seconds, 1),
            "rel_err_before": round(sum(e[0] for e in errs) / n, 5),
            "rel_err_after": round(sum(e[1] for e in errs) / n, 5),
            "per_module": [[round(b, 5), round(a, 5)] for b, a in errs]}


__all__ = ["FitOptions", "snapshot", "subgraph", "run_sequential", "ridge_refit", "rel_err",
           "quality", "fit_stats"]
