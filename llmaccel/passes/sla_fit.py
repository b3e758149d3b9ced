"""sla's attention transfer: each layer's W_q, W_k, W_v, its causal conv and W_o fitted together
to the original softmax attention block's output (gqa_fit's Adam fit with the linear attention in
place of softmax attention), before W_o's least-squares refit.

The ReLU feature map has no parameter of its own, but it reads the projections: phi(q) =
ReLU(x W_q^T), so fitting W_q and W_k is fitting the feature map (Hedgehog/LoLCATs-style attention
transfer, here with the map folded into the projections). As for gqa, the fitted layer is kept
only where it beats the closed-form start (conv and gain by least squares) on held-out windows.
"""
from __future__ import annotations

import torch

from llmaccel.ops.sla import sla_forward
from llmaccel.passes.gqa_fit import AttentionBlock
from llmaccel.ir import replace_weight, weight_of


class LinearBlock(AttentionBlock):
    """One layer's linear attention block as a function of its projections, conv weight and, with
    a window, the mix (trained too: the scale between the exact and the linear part)."""
    kwargs = ("n_heads", "n_kv_heads", "head_dim", "kernel_size", "eps")

    def __init__(self, gm, att):
        super().__init__(gm, att)
        self.kw.update({k: att.kwargs[k] for k in ("window", "sinks", "scale") if k in att.kwargs})

    def attend(self, q, k, v, p: dict) -> torch.Tensor:
        return sla_forward(q, k, v, p["conv"], mix=p.get("mix"), with_state=False, **self.kw)[0]

    def extra(self, gm) -> dict:
        out = {"conv": weight_of(gm, self.att.args[4]).float()}
        if len(self.att.args) > 5:
            out["mix"] = weight_of(gm, self.att.args[5]).float()
        return out

    def write_extra(self, gm, p: dict, dt) -> None:
        args = list(self.att.args)
        args[4] = replace_weight(gm, args[4], p["conv"].to(dt).contiguous(), self.att)
        if "mix" in p:
            args[5] = replace_weight(gm, args[5], p["mix"].float().contiguous(), self.att)
        self.att.args = tuple(args)
