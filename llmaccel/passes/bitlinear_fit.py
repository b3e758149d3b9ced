"""bitlinear's layer-local fit (`bitlinear.fit=true`): ternary codes and scales fitted to each
BitLinear's outputs. A helper module of the bitlinear pass, not a pass.

For one BitLinear (a group of linears sharing an input) with original weights W, inputs h at hand
(after the fused RMSNorm) and their int8-quantized form ĥ (what the op multiplies):
1. W* = argmin ||h Wᵀ - ĥ W*ᵀ||² (+ ridge towards W): the float weights that best give the
   original outputs from the quantized activations (quant.algorithms.source_correct);
2. GPTQ on W* with H = ĥᵀĥ over the ternary grid {-s, 0, +s} of each row (scale fixed: absmean at
   first), so each column's rounding error is compensated by the columns not yet rounded;
3. the scales refitted by least squares for those codes (per row, or per original linear for
   per_tensor), then GPTQ and the refit once more from the new scales.
The result with the least output error on the calibration tokens is kept, and the absmean
ternarization wherever it was better. It is written back as latent weights that the pass's own
ternarization maps exactly to the fitted codes and scales (latent = s·t / p, p the fraction of
non-zero codes: absmean(latent) = s and round(latent / s) = t), so packing, and heal's training
form, start from the fitted point.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmaccel.ir import replace_weight
from llmaccel.kernels.gptq import gptq_block
from llmaccel.ops import bitlinear as bl
from llmaccel.ops import rms_norm
from llmaccel.quant.algorithms import Grid, gptq, source_correct

_ROUNDS = 2


@dataclass
class _TernaryGrid(Grid):
    """Codes 0, 1, 2 with zero point 1 (values -s, 0, +s), one group per row, scales given."""
    row_scale: torch.Tensor | None = None

    @property
    def qmin(self):
        return 0

    @property
    def qmax(self):
        return 2

    def params(self, w, weight=None):
        s = self.row_scale[:, None].float().to(w.device)
        return s.clone(), torch.ones_like(s)


def _refit(w: torch.Tensor, t: torch.Tensor, H: torch.Tensor, scale: str, segments) -> torch.Tensor:
    """Scales minimising (w - s t) H (w - s t)ᵀ for fixed codes t: per row, or per segment."""
    tH = t @ H
    num, den = (tH * w).sum(1), (tH * t).sum(1)
    if scale == "per_tensor":
        num = torch.cat([p.sum().expand(len(p)) for p in num.split(list(segments))])
        den = torch.cat([p.sum().expand(len(p)) for p in den.split(list(segments))])
    s = num / den.clamp_min(1e-30)
    return torch.where(den > 0, s, torch.zeros_like(s)).clamp_min(1e-5)


def _latent(t: torch.Tensor, s: torch.Tensor, scale: str, segments) -> torch.Tensor:
    """Weights whose ternarization (ops.bitlinear.ternarize) is exactly (t, s)."""
    nz = (t != 0).float().mean(1)
    if scale == "per_tensor":
        nz = torch.cat([p.mean().expand(len(p)) for p in nz.split(list(segments))])
    return torch.where(nz[:, None] > 0, t * (s / nz.clamp_min(1e-12))[:, None], torch.zeros_like(t))


class _OutputError:
    """||h_src wᵀ - ĥ qᵀ||² / ||h_src wᵀ||² for any q (N, K), from K×K products only:
    tr(w Hs wᵀ) - 2 tr(w C qᵀ) + tr(q H qᵀ), Hs = h_srcᵀh_src, C = h_srcᵀĥ, H = ĥᵀĥ."""

    def __init__(self, w, h_src, hq, H):
        self.wC = w @ (h_src.T @ hq)
        self.H = H
        self.ref = ((w @ (h_src.T @ h_src)) * w).sum().item()

    def __call__(self, q: torch.Tensor) -> float:
        err = self.ref - 2 * (self.wC * q).sum().item() + ((q @ self.H) * q).sum().item()
        return max(err, 0.0) / max(self.ref, 1e-30)


def fit_codes(w: torch.Tensor, h: torch.Tensor, h_src: torch.Tensor, scale: str, segments, damp: float):
    """(t, s, error before, error after) for weights w (N, K) on inputs h (tokens, K), fitted to
    the outputs h_src wᵀ (h_src: the original model's inputs, or h itself)."""
    q, inv = bl.act_quant(h)
    hq = q / inv
    H = hq.T @ hq
    err = _OutputError(w, h_src, hq, H)
    t0, s0 = bl.ternarize(w, scale, segments)
    best = (t0, s0, err(t0 * s0[:, None]))
    before = best[2]
    w_star = source_correct(w, h_src, hq, damp)
    s = s0
    for _ in range(_ROUNDS):
        grid = _TernaryGrid(bits=2, gs=w.shape[1], row_scale=s)
        codes, _, _ = gptq(w_star, H, grid, act_order=True, damp=damp, block_fn=gptq_block)
        t = codes[:, : w.shape[1]] - 1
        s_new = _refit(w_star, t, H, scale, segments)
        for s_try in (s, s_new):
            e = err(t * s_try[:, None])
            if e < best[2]:
                best = (t, s_try, e)
        s = s_new
    return best[0], best[1], before, best[2]


def ternary_fit(gm, n, damp: float, errs: list, updates: list):
    """Fit callback of one training-form BitLinear node (bitlinear_train or the fused form)."""
    fused = n.target is bl.rms_norm_bitlinear_train
    w_i = 2 if fused else 1

    def site(interp, node):
        args = [interp.value(a) if hasattr(a, "op") else a for a in node.args]
        x = args[0]
        h = rms_norm(x, args[1], eps=node.kwargs["eps"]) if fused else x
        w = args[w_i]
        sc, seg = node.kwargs["scale"], node.kwargs["segments"]
        h_src = h if interp.source is None else interp.source.value(node.meta["fit_input"])
        flat = lambda t: t.reshape(-1, t.shape[-1]).float()  # noqa: E731
        t, s, before, after = fit_codes(w.float(), flat(h), flat(h_src), sc, seg, damp)
        errs.append((before, after))
        latent = _latent(t, s, sc, seg).to(w.dtype)
        args[w_i] = latent

        def write():
            node.update_arg(w_i, replace_weight(gm, node.args[w_i], latent, node))
        updates.append(write)
        return node.target(*args, **node.kwargs)
    return site
