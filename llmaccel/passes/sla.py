"""sla: softmax attention -> SLAB simplified linear attention (ReLU feature map, normalized causal
linear attention, plus a causal depthwise convolution on the values).

Every `attention` (or `kv_quant_attention`) node becomes `llmaccel.ops.sla.linear_attention`
reading the same q, k, v and a new per-layer weight `layers.{i}.sla_conv.weight` of shape
(n_heads * head_dim, kernel_size): one filter per query head, so in a GQA model the query heads
that share a KV head still get their own local mixing; the recurrent state is unchanged by this
choice (it holds the last kernel_size - 1 values per KV channel).

Initial conv weights (`sla.init`):
- `fit` (default): least squares on calibration text. Per layer and output channel, with the
  graph's own q, k, v, softmax output ~ gain * linear-attention output + conv(v), ridge-
  regularised. The gain is folded into the columns of W_o (the conv weights divided by it), so
  the op itself stays gain-free; where W_o is not a plain float linear read only by this
  attention (e.g. quantized), the gain stays 1 and only the conv is fitted. Softmax attention
  of a trained model puts much of its mass on the last few tokens, which a short filter
  captures, and linear attention over-smooths, which the gain shrinks: on SmolLM2-135M the
  relative squared error of the attention outputs goes from 1.41 (pure linear attention) to
  0.93 (conv) and 0.49 (conv + gain), averaged over layers (PPL 3597 -> 464 unhealed).
- `zeros`: pure linear attention; heal learns the conv from zero (its gradient at zero is the
  shifted values, not zero).

Layer-local fitting (`sla.fit=true`, fitting.py): per layer, W_q, W_k, W_v, the conv and W_o are
first fitted by Adam to the softmax attention block's output (attention transfer; sla_fit.py:
the ReLU feature map reads the projections, so fitting them fits the map), kept where they beat
the closed-form start on held-out windows, then W_o is refitted by least squares.

Window (`sla.window=W`, `sla.sinks=N`; 0 = SLAB as published): exact softmax attention over the
last W tokens and the first N, linear attention over the tokens between, one normalizer
(ops/sla_window.py, LoLCATs' hybrid), a new per-layer weight `layers.{i}.sla_mix.weight` (one
log-scale per query head) started where the linear part's mass on calibration text matches the
softmax's mass on the same tokens; the conv, the gain and the attention transfer are then fitted
with the window in place. The state keeps N + W - 1 keys and values more per layer.

Stats: layers replaced, KV bytes per token before (bf16) vs recurrent-state bytes per sequence
after (constant in length), the length where the two break even, and for `fit` the mean
relative error of the attention output without and with the fitted conv on calibration text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.ops.kvquant import kv_quant_attention
from llmaccel.ops.sla import _expand_v, linear_attention, sla_forward, state_bytes
from llmaccel.ops.sla_window import mix_init
from llmaccel.passes.base import Pass, PassContext, PassResult
from llmaccel.passes.fitting import FitOptions, snapshot
from llmaccel.passes.fuse import unfused
from llmaccel.passes.gqa_fit import fit_attention
from llmaccel.passes.sla_fit import LinearBlock
from llmaccel.ir import add_weight, is_op, op_nodes, probe, replace_weight, weight_of


@dataclass
class SLAConfig(FitOptions):
    kernel_size: int = 4
    eps: float = 1e-6
    init: Literal["fit", "zeros"] = "fit"
    calib_samples: int = 8
    calib_seq_len: int = 256
    ridge: float = 1e-3  # relative to the mean diagonal of each channel's Gram matrix
    gain: bool = True    # fit: also a per-channel gain on linear attention, folded into W_o
    # with fit=true: Adam steps per layer fitting W_q, W_k, W_v, the conv and W_o to the softmax
    # attention block's output (attention transfer, passes/sla_fit.py; 0: only W_o is refitted)
    # and their learning rate (relative to each weight's RMS)
    fit_qkv_steps: int = 150
    fit_qkv_lr: float = 0.01
    # exact softmax attention over the last `window` tokens and the first `sinks` (0: none)
    window: int = 0
    sinks: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.kernel_size <= 64:
            raise LlmaccelError(f"sla.kernel_size must be in 1..64, got {self.kernel_size}")
        if not self.eps > 0:
            raise LlmaccelError(f"sla.eps must be positive, got {self.eps}")
        if self.calib_samples < 1 or self.calib_seq_len < 2:
            raise LlmaccelError("sla.calib_samples and sla.calib_seq_len must be positive")
        if self.ridge < 0:
            raise LlmaccelError(f"sla.ridge must not be negative, got {self.ridge}")
        if self.fit_qkv_steps < 0 or self.fit_qkv_lr <= 0:
            raise LlmaccelError("sla.fit_qkv_steps must be >= 0 and sla.fit_qkv_lr positive")
        if self.window < 0 or self.sinks < 0:
            raise LlmaccelError(f"sla.window and sla.sinks must not be negative, got {self.window} "
                                f"and {self.sinks}")
        if self.sinks and not self.window:
            raise LlmaccelError("sla.sinks needs sla.window: without a window every token is linear")


def _taps(x: torch.Tensor, K: int) -> torch.Tensor:
    """(T, C) -> (T, C, K): x[t - (K-1) + j, c], zero before the first token."""
    xp = torch.cat([x.new_zeros(K - 1, x.shape[1]), x], 0)
    return torch.stack([xp[j:j + x.shape[0]] for j in range(K)], -1)


def _o_linear(gm: torch.fx.GraphModule, att: torch.fx.Node) -> torch.fx.Node | None:
    """The plain float linear that alone reads this attention's output, if there is one."""
    users = list(att.users)
    if len(users) != 1 or not is_op(users[0], ops.linear) or users[0].args[0] is not att:
        return None
    w = weight_of(gm, users[0].args[1])
    return users[0] if w.is_floating_point() and w.dim() == 2 else None


def _scale(n: torch.fx.Node) -> float:
    return n.kwargs.get("scale") or n.kwargs["head_dim"] ** -0.5


@torch.no_grad()
def fit_mix(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], ids: torch.Tensor, window: int,
            sinks: int) -> list[torch.Tensor]:
    """Per layer, the log-scale per query head that gives the window's linear part the mass the
    softmax puts on the same tokens, summed over the calibration windows (0 where none has any)."""
    probed = probe(gm, [x for n in nodes for x in n.args[:2]])
    soft, lin = [0.0] * len(nodes), [0.0] * len(nodes)
    for i in range(ids.shape[0]):
        x = ids[i:i + 1]
        vals = probed(x, torch.arange(x.shape[1], device=x.device)[None], None)
        for li, n in enumerate(nodes):
            kw = n.kwargs
            a, b = mix_init(vals[2 * li].float(), vals[2 * li + 1].float(), n_heads=kw["n_heads"],
                            n_kv_heads=kw["n_kv_heads"], head_dim=kw["head_dim"], window=window,
                            sinks=sinks, scale=_scale(n))
            soft[li], lin[li] = soft[li] + a, lin[li] + b
    return [torch.where((a > 0) & (b > 0), a.clamp_min(1e-300).log() - b.clamp_min(1e-300).log(),
                        torch.zeros_like(a)).float() for a, b in zip(soft, lin)]


@torch.no_grad()
def fit_conv(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], ids: torch.Tensor, K: int,
             eps: float, ridge: float, progress, win: list[dict] | None = None) -> list[dict]:
    """Per layer, least-squares statistics of softmax output ~ gain * linear-attention + conv(v).

    Per channel c of the H*D outputs, the regressors are the K value taps and the linear-attention
    output; the Gram matrix (C, K+1, K+1) and right-hand side are summed over calibration tokens.
    `win`: per layer, the window's options (window, sinks, scale, mix) of the linear attention.
    """
    probed = probe(gm, [x for n in nodes for x in (*n.args[:3], n)])
    acc = [{"gram": 0, "xr": 0, "aa": 0} for _ in nodes]
    for i in progress(range(ids.shape[0]), desc="sla fit"):
        x = ids[i:i + 1]
        vals = probed(x, torch.arange(x.shape[1], device=x.device)[None], None)
        for li, n in enumerate(nodes):
            kw = n.kwargs
            H, Hkv, D = kw["n_heads"], kw["n_kv_heads"], kw["head_dim"]
            q, k, v, att = (t.float() for t in vals[4 * li: 4 * li + 4])
            la = sla_forward(q, k, v, q.new_zeros(H * D, K), n_heads=H, n_kv_heads=Hkv,
                             head_dim=D, kernel_size=K, eps=eps, with_state=False,
                             **(win[li] if win else {}))[0]
            X = torch.cat([_taps(_expand_v(v, Hkv, H // Hkv, D)[0].double(), K),
                           la[0].double()[..., None]], -1)                 # (T, H*D, K+1)
            a, t = acc[li], att[0].double()
            a["gram"] = a["gram"] + torch.einsum("tck,tcl->ckl", X, X)
            a["xr"] = a["xr"] + torch.einsum("tck,tc->ck", X, t)
            a["aa"] = a["aa"] + (t * t).sum()
    return acc


def _rel_err(a: dict, coef: torch.Tensor) -> float:
    """||att - X coef||^2 / ||att||^2 from the accumulated statistics (||att||^2 = aa)."""
    gram, xr = a["gram"], a["xr"]
    r = a["aa"] - 2 * (coef * xr).sum() + torch.einsum("ck,ckl,cl->", coef, gram, coef)
    return (r.clamp_min(0) / a["aa"]).item()


def solve_fit(a: dict, K: int, ridge: float, with_gain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv (C, K), gain (C,)): joint ridge fit, or conv alone with gain 1.

    The gain is kept at least a tenth of the median |gain| in magnitude: it is folded into W_o
    and the conv weights are divided by it.
    """
    gram, xr = a["gram"], a["xr"]
    C = gram.shape[0]
    if with_gain:
        lam = ridge * gram.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).clamp_min(1e-12)
        coef = torch.linalg.solve(gram + torch.diag_embed(lam.expand(C, K + 1)), xr)
        gain = coef[:, K]
        floor = 0.1 * gain.abs().median().clamp_min(1e-6)
        gain = torch.where(gain >= 0, gain.clamp_min(floor), gain.clamp_max(-floor))
    else:
        gain = torch.ones(C, dtype=gram.dtype)
    gt = gram[:, :K, :K]
    lam = ridge * gt.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).clamp_min(1e-12)
    rhs = xr[:, :K] - gain[:, None] * gram[:, :K, K]   # fit what gain * linear attention misses
    conv = torch.linalg.solve(gt + torch.diag_embed(lam.expand(C, K)), rhs)
    return conv, gain


class SLA(Pass):
    name = "sla"
    summary = "softmax attention -> SLAB linear attention (ReLU kernel + depthwise conv on V)"
    exact = False
    config_cls = SLAConfig

    def _fit_convs(self, gm, nodes, ids, ctx: PassContext, win, stats: dict) -> list:
        """init=fit: each layer's conv (and gain, folded into W_o) solved in closed form against
        the softmax attention's output on the calibration windows; their errors into stats."""
        c = self.config
        acc = fit_conv(gm, nodes, ids, c.kernel_size, c.eps, c.ridge, ctx.progress, win)
        lin, err, gains, fits = [], [], 0, []
        for n, a in zip(nodes, acc):
            o = _o_linear(gm, n) if c.gain else None
            conv, gain = solve_fit(a, c.kernel_size, c.ridge, o is not None)
            ones = torch.zeros_like(a["xr"])
            ones[:, -1] = 1
            lin.append(_rel_err(a, ones))
            err.append(_rel_err(a, torch.cat([conv, gain[:, None]], 1)))
            if o is not None:  # W_o (gain * la + conv) = (W_o diag(gain)) (la + conv / gain)
                wo = weight_of(gm, o.args[1])
                new = (wo.double() * gain.to(wo.device)[None, :]).to(wo.dtype)
                o.args = (o.args[0], replace_weight(gm, o.args[1], new, o), *o.args[2:])
                conv = conv / gain[:, None]
                gains += 1
            fits.append(conv.float())
        stats.update({"attn_rel_err_linear": round(sum(lin) / len(lin), 4),
                      "attn_rel_err_fit": round(sum(err) / len(err), 4),
                      "gain_folded_layers": gains, "fit_tokens": ids.numel()})
        return fits

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        nodes = op_nodes(gm, ops.attention, kv_quant_attention)
        if not nodes:
            raise LlmaccelError("sla: the graph has no softmax attention node to replace")
        p0 = next(gm.parameters())
        orig = snapshot(gm) if c.fit else None
        stats: dict = {"init": c.init}
        fits = [None] * len(nodes)
        win = None
        if c.window or c.init == "fit":
            ids = ctx.calib_tokens(c.calib_samples, c.calib_seq_len).to(p0.device)
        if c.window:
            win = [{"window": c.window, "sinks": c.sinks, "scale": _scale(n), "mix": m.to(p0.device)}
                   for n, m in zip(nodes, fit_mix(gm, nodes, ids, c.window, c.sinks))]
            stats.update({"window": c.window, "sinks": c.sinks,
                          "mix_mean": round(sum(w["mix"].mean().item() for w in win) / len(win), 3)})
        if c.init == "fit":
            fits = self._fit_convs(gm, nodes, ids, ctx, win, stats)
        kv_bytes = state = 0
        for i, n in enumerate(nodes):
            kw = n.kwargs
            H, Hkv, D, layer = kw["n_heads"], kw["n_kv_heads"], kw["head_dim"], kw["layer"]
            if H % Hkv:
                raise LlmaccelError(f"sla: layer {layer} has {H} heads, not a multiple of {Hkv} KV heads")
            w = fits[i] if c.init == "fit" else torch.zeros(H * D, c.kernel_size)
            wn = add_weight(gm, f"layers.{layer}.sla_conv.weight", w.to(p0.dtype).to(p0.device), n)
            q, k, v, actx = n.args[:4]
            kwargs = {"layer": layer, "n_heads": H, "n_kv_heads": Hkv, "head_dim": D,
                      "kernel_size": c.kernel_size, "eps": c.eps}
            args = (q, k, v, actx, wn)
            if win:   # the mix stays fp32: it is exponentiated
                args += (add_weight(gm, f"layers.{layer}.sla_mix.weight", win[i]["mix"].float(), n),)
                kwargs.update(window=c.window, sinks=c.sinks, scale=win[i]["scale"])
            n.target, n.args, n.kwargs = linear_attention, args, kwargs
            kv_bytes += 2 * Hkv * D * 2
            state += state_bytes(Hkv, D, c.kernel_size, 2, window=c.window, sinks=c.sinks)
        stats.update({
            "layers": len(nodes), "attention_ops_replaced": len(nodes), "kernel_size": c.kernel_size,
            "conv_params": len(nodes) * H * D * c.kernel_size,
            "kv_bytes_per_token_before": kv_bytes,         # bf16 K and V, all layers
            "state_bytes_per_sequence": state,             # fp32 S, z + bf16 conv tail, all layers
            "break_even_tokens": round(state / kv_bytes, 1),
        })
        if c.fit:
            with unfused(gm):   # the q/k/v fit rewrites the q, k and v linears one by one
                stats["fit"] = fit_attention(gm, ctx, c, orig, nodes, "sla fit", LinearBlock)
        return PassResult(gm, len(nodes), stats)


PASS = SLA
