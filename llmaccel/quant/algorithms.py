"""Quantization grid (scale/zero per row and group) and the calibrated algorithms: AWQ scale and
clipping searches, GPTQ, and the source-target weight correction. Plain tensor functions (no
graph), device-agnostic; the storage layout they produce is llmaccel/ops/quant.py's."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Grid:
    """Quantization grid. Columns are zero-padded to whole groups (as MatMulNBits pads K); as
    every range includes 0, padding changes no scale or zero and dequantizes to exactly 0.

    `search` > 0 (int4): each (row, group) range [min, max] is shrunk by the factor, of `search`
    steps from 1 down to `min_shrink`, with the least (column-weighted) squared weight error;
    min/max rounding wastes levels on a group's extreme values, which the search trades off.
    """
    bits: int
    gs: int      # columns per group (K for int8)
    search: int = 0
    min_shrink: float = 0.5

    @property
    def qmin(self):
        return 0 if self.bits == 4 else -127

    @property
    def qmax(self):
        return 15 if self.bits == 4 else 127

    def pad(self, w: torch.Tensor) -> torch.Tensor:
        return F.pad(w, (0, -w.shape[-1] % self.gs))

    def _groups(self, w: torch.Tensor) -> torch.Tensor:
        return self.pad(w).reshape(w.shape[0], -1, self.gs)

    @staticmethod
    def _minmax_params(mx, mn):
        scale = ((mx - mn) / 15).clamp_min(1e-12)
        return scale, (-mn / scale).round().clamp(0, 15)

    def params(self, w: torch.Tensor, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, K) weights -> scale, zero of shape (N, ceil(K / gs)); `weight` (K,): per-column
        importance for the range search (e.g. the Hessian diagonal), uniform when None."""
        wg = self._groups(w)
        if self.bits == 8:
            scale = (wg.abs().amax(-1) / 127).clamp_min(1e-12)
            return scale, torch.zeros_like(scale)
        mx, mn = wg.amax(-1).clamp_min(0), wg.amin(-1).clamp_max(0)
        scale, zero = self._minmax_params(mx, mn)
        if not self.search:
            return scale, zero
        wt = 1.0 if weight is None else self.pad(weight.float()[None]).reshape(1, -1, self.gs)
        best = self._err(wg, scale, zero, wt)
        for i in range(1, self.search + 1):
            r = 1 - i * (1 - self.min_shrink) / self.search
            s, z = self._minmax_params(mx * r, mn * r)
            err = self._err(wg, s, z, wt)
            better = err < best
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
        return scale, zero

    def _err(self, wg, s, z, wt):
        q = (wg / s[..., None]).round().add(z[..., None]).clamp(self.qmin, self.qmax)
        return ((q - z[..., None]) * s[..., None] - wg).pow(2).mul(wt).sum(-1)

    def codes(self, w, scale, zero):
        """Integer codes (as floats) of the padded w."""
        wg = self._groups(w)
        q = (wg / scale[..., None]).round_().add_(zero[..., None]).clamp_(self.qmin, self.qmax)
        return q.reshape(w.shape[0], -1)

    def dequant(self, q, scale, zero, K: int):
        qg = q.reshape(q.shape[0], -1, self.gs)
        return ((qg - zero[..., None]) * scale[..., None]).reshape(q.shape[0], -1)[:, :K]

    def rtn(self, w, weight=None):
        scale, zero = self.params(w, weight)
        return self.dequant(self.codes(w, scale, zero), scale, zero, w.shape[1])


def _tied(v: torch.Tensor, tie):
    if tie is None:
        return v
    n_kv, rep = tie
    return v.view(n_kv, rep, -1).mean(1, keepdim=True).expand(n_kv, rep, -1).reshape(-1)


def awq_scale(x: torch.Tensor, ws: list[torch.Tensor], grid: Grid, n_grid: int = 20,
              tie: tuple[int, int] | None = None, duo: bool = False) -> torch.Tensor:
    """Per-input-channel scale s minimising ||x W^T - (x / s) Q(W s)^T|| over s = mean|x|^a
    (and, with `duo`, also over AutoAWQ's s = mean|x|^a / mean|ŵ|^(1-a), ŵ = |W| over its group max).

    tie=(n_kv_heads, heads_per_kv): the input is GQA attention output, whose channels of heads
    sharing a KV head all come from one v channel; s is averaged over those heads so that 1/s
    can be folded into v's rows.
    """
    ref = torch.cat([x @ w.T for w in ws], -1)
    x_mean = _tied(x.abs().mean(0), tie)
    cands = [x_mean.pow(i / n_grid) for i in range(n_grid)]
    if duo:
        wa = torch.cat(ws).abs()
        wg = grid.pad(wa).reshape(wa.shape[0], -1, grid.gs)
        w_mean = (wg / wg.amax(-1, keepdim=True).clamp_min(1e-12)).reshape(wa.shape[0], -1)
        w_mean = _tied(w_mean[:, : wa.shape[1]].mean(0), tie)
        cands += [x_mean.pow(i / n_grid) / (w_mean.pow(1 - i / n_grid) + 1e-4) for i in range(n_grid)]
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for s in cands:
        s = s.clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        out = torch.cat([x @ (grid.rtn(w * s) / s).T for w in ws], -1)
        loss = (out - ref).pow(2).mean().item()
        if loss < best:
            best, best_s = loss, s
    return best_s


def smooth_scale(x: torch.Tensor, ws: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s = max|x_j|^alpha / max|w_j|^(1 - alpha) (x
    (tokens, K) of calibration text; ws the weights (rows, K) reading it): x / s and w * s give
    the same product, with x's outlier channels moved into the weights, which are quantized per
    row. Channels never active (or of all-zero weights) keep s = 1."""
    a = x.abs().amax(0).float()
    w = torch.cat(ws).abs().amax(0).float()
    s = a.pow(alpha) / w.pow(1 - alpha)
    ok = (a > 0) & (w > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s)).clamp(1e-5, 1e5)


def awq_clip(x: torch.Tensor, w: torch.Tensor, grid: Grid, n_grid: int = 20,
             max_shrink: float = 0.5, chunk: int = 256) -> torch.Tensor:
    """Clamp each (row, group) of w to a shrunk range chosen to minimise that group's output
    error on the inputs x (min/max rounding of the clamped group, as `Grid(search=0)` does).
    Shrink factor 1 (no clipping) is in the search, so no group's error grows."""
    plain = Grid(grid.bits, grid.gs)
    N, K = w.shape
    wg = plain.pad(w).reshape(N, -1, grid.gs)             # (N, G, gs)
    xg = plain.pad(x).reshape(x.shape[0], -1, grid.gs)    # (n, G, gs)
    mx0, mn0 = wg.amax(-1, keepdim=True).clamp_min(0), wg.amin(-1, keepdim=True).clamp_max(0)
    best_err = torch.full(wg.shape[:2], float("inf"), device=w.device)
    best = wg
    for i in range(int(max_shrink * n_grid)):
        r = 1 - i / n_grid
        c = wg.clamp(mn0 * r, mx0 * r)
        diff = wg - plain.rtn(c.reshape(N, -1)).reshape_as(wg)
        # rows in chunks: the (rows, tokens, groups) product is the memory peak
        err = torch.cat([torch.einsum("ngk,tgk->ntg", d, xg).pow(2).mean(1)
                         for d in diff.split(chunk)])                  # (N, G)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], c, best)
    return best.reshape(N, -1)[:, :K]


def source_correct(w: torch.Tensor, x_src: torch.Tensor, x_q: torch.Tensor, damp: float) -> torch.Tensor:
    """W* = argmin ||x_src Wᵀ - x_q W*ᵀ||² + λ||W* - W||²: the float weights that best give the
    source model's outputs from the inputs the quantized layers before produce (GPTAQ's
    asymmetric calibration). As W* solves that least-squares problem, ||x_src Wᵀ - x_q Qᵀ||² =
    const + ||x_q (W* - Q)ᵀ||² (for λ → 0), so quantizing W* with GPTQ on H = x_qᵀx_q fits the
    source outputs. The ridge pulls towards W, not 0: channels the few calibration tokens barely
    excite keep their weights (λ = damp × mean diagonal of H)."""
    # products in float32 (the token count is large), the solve in float64
    H = (x_q.T @ x_q).double()
    lam = damp * H.diagonal().mean() + 1e-12
    idx = torch.arange(H.shape[0], device=H.device)
    H[idx, idx] += lam
    C = (x_src.T @ x_q).double()                                       # (K, K)
    L = torch.linalg.cholesky(H)
    wd = w.double()
    return torch.cholesky_solve((wd @ C + lam * wd).T, L).T.to(w.dtype)


def refit_scales(w: torch.Tensor, H: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Per-group scales minimising (w - ŵ) H (w - ŵ)ᵀ per row for fixed codes q and zeros z, with
    ŵ = (q - z)·s group-wise: a G×G least-squares system per row (G groups). The current
    scales are a feasible point, so rows where the solve does not lower the error keep them."""
    N, K = w.shape
    Kp, G, gs = q.shape[1], scale.shape[1], grid.gs
    # products in float32 (N·K² flops), the G×G solves in float64
    Wp = grid.pad(w.float())
    Hp = F.pad(H.float(), (0, Kp - H.shape[0], 0, Kp - H.shape[0]))
    A = q.reshape(N, G, gs).float() - zero[..., None].float()             # (N, G, gs)
    M = torch.empty(N, G, G, dtype=torch.float64, device=w.device)
    for g in range(G):
        AH = A[:, g] @ Hp[g * gs:(g + 1) * gs]                             # (N, Kp)
        M[:, g] = (AH.view(N, G, gs) * A).sum(-1).double()
    b = ((Wp @ Hp).view(N, G, gs) * A).sum(-1).double()                    # (N, G)
    ridge = 1e-9 * M.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-30)
    Mr = M + ridge[:, None, None] * torch.eye(G, dtype=M.dtype, device=M.device)
    new = torch.linalg.solve(Mr, b[..., None])[..., 0]
    old = scale.double()
    new = torch.where(torch.isfinite(new) & (new > 0), new, old)       # e.g. an all-zero group

    def err(s):   # (w - ŵ) H (w - ŵ)ᵀ up to the constant w H wᵀ
        return (s[:, None, :] @ M @ s[..., None])[:, 0, 0] - 2 * (s * b).sum(-1)
    ok = err(new) < err(old)
    return torch.where(ok[:, None], new.to(scale.dtype), scale)


def gptq_block_ref(W1: torch.Tensor, Hi: torch.Tensor, S: torch.Tensor, Z: torch.Tensor,
                   qmin: float, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One GPTQ block whose grid parameters are fixed per column: W1 (N, b) quantized column by
    column with scales S and zeros Z (N, b), each column's rounding error, divided by Hi's
    diagonal, spread over the block's later columns by Hi's row (Hi: the block's (b, b) part of
    the upper Cholesky factor of H⁻¹). Returns the codes and the scaled errors (N, b), the
    update of the columns after the block. Rows are independent; W1 is left unchanged.

    Columns are kept as rows of transposed copies (each step touches contiguous memory), and a
    step is nine tensor ops: on a GPU the loop is launch-bound (kernels/gptq.py does the whole
    block in one launch)."""
    WT, ST, ZT = W1.t().contiguous(), S.t().contiguous(), Z.t().contiguous()
    QT, ET = torch.empty_like(WT), torch.empty_like(WT)
    d = Hi.diagonal()
    for i in range(WT.shape[0]):
        w, s, z, q, e = WT[i], ST[i], ZT[i], QT[i], ET[i]
        torch.div(w, s, out=q).round_().add_(z).clamp_(qmin, qmax)
        torch.sub(q, z, out=e).mul_(s)                 # the dequantized column
        torch.sub(w, e, out=e).div_(d[i])              # its error over the diagonal
        WT[i:].addr_(Hi[i, i:], e, alpha=-1)
    return QT.t(), ET.t()


def gptq(w: torch.Tensor, H: torch.Tensor, grid: Grid, *, act_order: bool, damp: float,
         block: int = 128, block_fn=gptq_block_ref) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ (Frantar et al.): returns integer codes, scale, zero for w (N, K) given H = X^T X.

    With act_order the group parameters are fixed from the weights beforehand ("static
    groups"), so groups stay contiguous in the stored layout whatever the column order; each
    block is then one `block_fn` call (gptq_block_ref's signature; the passes hand in the
    kernel's dispatcher). The range search (grid.search) weighs columns by the Hessian diagonal.
    """
    dev = w.device
    W = grid.pad(w.float())
    N, K = W.shape
    H = F.pad(H.float(), (0, K - H.shape[0], 0, K - H.shape[0]))  # padded columns are dead
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    hdiag = torch.diag(H).clone()
    static = act_order or grid.bits == 8
    scale, zero = grid.params(W, hdiag) if static else (None, None)
    if scale is None:
        scale = torch.empty(N, K // grid.gs, device=dev)
        zero = torch.empty_like(scale)
    perm = torch.argsort(hdiag, descending=True) if act_order else torch.arange(K, device=dev)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(K, device=dev)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    perm_l = perm.tolist()
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        if static:
            g = perm[i1:i2] // grid.gs
            Q[:, i1:i2], Err = block_fn(W[:, i1:i2], Hinv[i1:i2, i1:i2], scale[:, g], zero[:, g],
                                        grid.qmin, grid.qmax)
        else:
            Q[:, i1:i2], Err = _dynamic_block(W, Hinv, i1, i2, perm_l, hdiag, scale, zero, grid)
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]
    return Q[:, torch.argsort(perm)], scale, zero


def _dynamic_block(W, Hinv, i1, i2, perm_l, hdiag, scale, zero, grid: Grid):
    """A block of GPTQ without act_order at 4 bits: each group's parameters come from its
    columns as updated so far, taken when the group's first column is reached (written into
    scale and zero)."""
    W1, Hi = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
    Q1, Err = torch.zeros_like(W1), torch.zeros_like(W1)
    for i in range(i2 - i1):
        col = perm_l[i1 + i]
        g = col // grid.gs
        if col % grid.gs == 0:
            cols = torch.cat([W1[:, i:], W[:, i2:]], 1)[:, :grid.gs]
            s, z = grid.params(cols, hdiag[col:col + grid.gs])
            scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
        s, z = scale[:, g], zero[:, g]
        q = ((W1[:, i] / s).round() + z).clamp(grid.qmin, grid.qmax)
        Q1[:, i] = q
        e = (W1[:, i] - (q - z) * s) / Hi[i, i]
        W1[:, i:] -= e[:, None] * Hi[i, i:][None, :]
        Err[:, i] = e
    return Q1, Err
