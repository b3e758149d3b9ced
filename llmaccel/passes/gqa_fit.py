"""gqa's attention fit: the merged W_q, W_k, W_v (and biases) of one layer fitted to the original
attention block's output (the `prefit` of fitting.attention_sites), before the W_o refit.

Given the layer's input x, the merged block is differentiable in its projections:
q = rope(x W_qᵀ + b_q), k = rope(x W_kᵀ + b_k), v = x W_vᵀ + b_v (RoPE as the graph applies it),
out = attention(q, k, v) W_oᵀ + b_o. Adam minimises ||out - y||² / ||y||² (y: the original block's
output) over the calibration windows but the held-out ones, one window per step, starting from the
pass's PCA merge, with W_o trained alongside so that the projections are fitted for the read-out
they get. W_q is trained too: it holds the key merge's per-head fold, which the merged key can no
longer carry. Each candidate (the PCA merge, the fitted one) then gets W_o's least-squares refit
on the training windows (fitting.ridge_refit_validated) and is scored on the held-out windows; the
better one is kept, so the fit never makes a layer worse on tokens it did not train on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.ops.attention import causal_attention
from llmaccel.ops.rope import rope_at, rope_inv_freq
from llmaccel.ir import is_op, replace_weight, weight_of
from llmaccel.passes.fitting import attention_sites, fit_sites, quality, snapshot


@dataclass
class QKVFit:
    steps: int = 150        # Adam steps per layer
    lr: float = 0.01        # Adam learning rate, relative to each weight's RMS
    batch: int = 1          # calibration windows per step
    holdout: float = 0.25   # share of windows held out to choose PCA or fitted
    train_q: bool = True    # W_q (and its bias) trained too: it holds the key merge's fold


def _wb(gm, lin: torch.fx.Node):
    b = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
    return weight_of(gm, lin.args[1]), weight_of(gm, b)


class AttentionBlock:
    """The merged attention block of one layer as a function of its projections."""
    kwargs = ("n_heads", "n_kv_heads", "head_dim", "scale")

    def __init__(self, gm, att: torch.fx.Node):
        self.att = att
        self.kw = {k: att.kwargs[k] for k in self.kwargs}
        q, k = att.args[0], att.args[1]
        self.rope = is_op(k, ops.rope)
        self.inv_freq = None
        if self.rope:
            rk = k.kwargs
            self.inv_freq = rope_inv_freq(rk["head_dim"], rk["theta"], rk.get("scaling"))
            q, k = q.args[0], k.args[0]
        self.lin = {"q": q, "k": k, "v": att.args[2]}
        self.wq, self.bq = _wb(gm, q)

    def _rope(self, t, pos):
        if not self.rope:
            return t
        return rope_at(t, pos, self.inv_freq.to(t.device), head_dim=self.kw["head_dim"])

    def queries(self, x, pos):
        return self._rope(F.linear(x, self.wq.float(), None if self.bq is None else self.bq.float()), pos)

    def heads(self, q, x, pos, p: dict) -> torch.Tensor:
        if "wq" in p:
            q = self._rope(F.linear(x, p["wq"], p.get("bq")), pos)
        k = self._rope(F.linear(x, p["wk"], p.get("bk")), pos)
        v = F.linear(x, p["wv"], p.get("bv"))
        return self.attend(q, k, v, p)

    def attend(self, q, k, v, p: dict) -> torch.Tensor:
        return causal_attention(q, k, v, **self.kw)

    def extra(self, gm) -> dict:
        """Parameters of the attention op itself that the fit trains beside the projections."""
        return {}

    def write_extra(self, gm, p: dict, dt) -> None:
        """Install what extra() trained."""


def _split(n: int, holdout: float) -> tuple[slice, slice]:
    held = min(n - 1, max(1, round(n * holdout))) if n > 1 else 0
    return slice(0, n - held), slice(n - held, n)


def _score(block, q, x, pos, y, p, tr, va) -> tuple[float, torch.Tensor]:
    """Held-out error of these projections after W_o's least-squares refit on the training windows."""
    from llmaccel.passes.fitting import rel_err, ridge_refit_validated
    with torch.no_grad():
        z = block.heads(q, x, pos, p)
        target = y - (0 if p.get("bo") is None else p["bo"])
        w = ridge_refit_validated(p["wo"], z[tr].flatten(0, -2), target[tr].flatten(0, -2))
        return rel_err(F.linear(z[va], w, p.get("bo")), y[va]), z


def start_params(gm, block: AttentionBlock, wo: torch.Tensor, bo: torch.Tensor | None) -> dict:
    """The merge as it is (fp32): wk, wv, wo and the biases that exist (bk, bv, bo), and the
    attention op's own parameters (block.extra)."""
    start = {"wo": wo.float(), "bo": None if bo is None else bo.float(), **block.extra(gm)}
    for name in "kv":
        w, b = _wb(gm, block.lin[name])
        start[f"w{name}"] = w.float()
        if b is not None:
            start[f"b{name}"] = b.float()
    return start


def fit_qkv(block: AttentionBlock, start: dict, x: torch.Tensor, pos: torch.Tensor, y: torch.Tensor,
           opt: QKVFit):
    """Fitted projections of one layer: (params or None where the PCA merge stays, held-out errors)."""
    x, y = x.float(), y.float()
    tr, va = _split(x.shape[0], opt.holdout)
    with torch.no_grad():
        q = block.queries(x, pos)
    base, _ = _score(block, q, x, pos, y, start, tr, va)
    info = {"pca": base}
    if opt.steps <= 0 or va.stop == va.start:
        return None, info
    if opt.train_q:
        start = {**start, "wq": block.wq.float()}
        if block.bq is not None:
            start["bq"] = block.bq.float()
    train = {k: v.clone().requires_grad_(True) for k, v in start.items()
             if v is not None and k != "bo"}
    n_tr = tr.stop
    ynorm = y[tr].pow(2).mean()
    with torch.enable_grad():   # the sequential fit runs under no_grad
        _adam(block, q, x, pos, y, train, start["bo"], n_tr, ynorm, opt)
    fitted = {**start, **{k: v.detach() for k, v in train.items()}}
    err, _ = _score(block, q, x, pos, y, fitted, tr, va)
    info["fitted"] = err
    return (fitted if err < base else None), info


def _adam(block, q, x, pos, y, train: dict, bo, n_tr: int, ynorm, opt: QKVFit) -> None:
    # a bias (maybe all zero) moves at its weight's scale
    rms = {k: train["w" + k[1:] if k[0] == "b" else k].detach().pow(2).mean().sqrt().item() for k in train}
    groups = [{"params": [t], "lr": opt.lr * rms[k]} for k, t in train.items()]
    adam = torch.optim.Adam(groups, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(adam, opt.steps)
    gen = torch.Generator().manual_seed(0)
    for _ in range(opt.steps):
        idx = torch.randperm(n_tr, generator=gen)[: opt.batch]
        p = {**train, "bo": bo}
        out = F.linear(block.heads(q[idx], x[idx], pos[idx], p), p["wo"], p["bo"])
        loss = (out - y[idx]).pow(2).mean() / ynorm
        adam.zero_grad(set_to_none=True)
        loss.backward()
        adam.step()
        sched.step()


def qkv_prefit(gm, opt: QKVFit, log: list, block_cls=AttentionBlock):
    """fitting.attention_sites' prefit for gqa (and sla, with its block): fits the layer's
    projections; when the fit wins on held-out windows it returns the new attention output, the
    W_o trained with them (the start of W_o's refit) and the rewrite that installs them (else
    None). Appends the errors to log."""
    def prefit(att, x, pos, y, wo, bo):
        block = block_cls(gm, att)
        p, info = fit_qkv(block, start_params(gm, block, wo, bo), x, pos, y, opt)
        log.append(info)
        if p is None:
            return None
        dt = wo.dtype

        def write():
            for name in [n for n in "qkv" if f"w{n}" in p]:
                lin = block.lin[name]
                w_node = replace_weight(gm, lin.args[1], p[f"w{name}"].to(dt).contiguous(), lin)
                b_old = lin.args[2] if len(lin.args) > 2 else None
                b_node = b_old if b_old is None else replace_weight(gm, b_old, p[f"b{name}"].to(dt).contiguous(), lin)
                lin.args = (lin.args[0], w_node, b_node)
            block.write_extra(gm, p, dt)
            info["installed"] = True   # the layer's W_o refit kept it (the site may refuse both)
        with torch.no_grad():
            z = block.heads(block.queries(x.float(), pos), x.float(), pos, p)
        return z.to(x.dtype), p["wo"].to(dt), write
    return prefit


def qkv_summary(log: list[dict]) -> dict:
    """The stats of a qkv_prefit run (after the fit's rewrites): layers whose fitted projections
    were installed, each layer's held-out errors (closed-form start, fitted)."""
    return {"layers_fitted": sum(bool(e.get("installed")) for e in log),
            "heldout_err": [[round(e["pca"], 5), round(e.get("fitted", e["pca"]), 5)] for e in log]}


def fit_attention(gm, ctx, c, orig, atts: list, desc: str, block_cls=AttentionBlock) -> dict:
    """The layer-local fit of gqa's and sla's attention blocks (the graph's q/k/v unfused): each
    layer's projections fitted first where c.fit_qkv_steps (qkv_prefit), then W_o refitted
    (fitting.attention_sites); the stats, with quality before and after (c.fit_report_tokens)."""
    gm.graph.lint()
    gm.recompile()
    unfitted = snapshot(gm)
    log: list[dict] = []
    prefit = (qkv_prefit(gm, QKVFit(steps=c.fit_qkv_steps, lr=c.fit_qkv_lr), log, block_cls)
              if c.fit_qkv_steps else None)
    st = fit_sites(gm, ctx, c, attention_sites(gm, orig, atts, prefit), desc, orig)
    if log:
        st["qkv_fit"] = qkv_summary(log)
    if c.fit_report_tokens:
        st["quality"] = quality(ctx, {"unfitted": unfitted, "fitted": gm}, c.fit_report_tokens)
    return st
