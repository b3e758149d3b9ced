"""gqa: merge KV heads (MHA -> GQA -> MQA) so the KV cache shrinks by n_kv_heads / gqa.kv_heads.

Methods:
- `mean`: contiguous groups of KV heads, K/V projections mean-pooled (the GQA paper's conversion).
- `cluster`: groups of KV heads chosen by the similarity of their K/V outputs on calibration
  text; query heads (rows of W_q, columns of W_o) are permuted so each group's query heads are
  contiguous, then K/V projections are mean-pooled.
- `pca`: similarity groups, then a data-fitted low-rank merge. V: the merged head is the top
  head_dim principal subspace of the group's stacked values, and each query head's share of W_o
  absorbs the map back. K (Llama, RoPE): per rotary frequency the group's keys are complex
  numbers; the merged key is their top complex principal component (weighted by query energy),
  and each query head absorbs its head's complex coefficient into its W_q rows. A per-frequency
  complex scale commutes with RoPE, so the fold is exact up to the rank-1 fit. GPT-2 (no RoPE)
  uses the real PCA for K as for V.

Works on float graphs, before or after `fuse` (fused q/k/v linears are split for the merge and
fused again afterwards); quantized linears must come after gqa.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.passes.base import Pass, PassContext, PassResult
from llmaccel.passes.fitting import FitOptions, snapshot
from llmaccel.passes.fuse import unfused
from llmaccel.passes.gqa_fit import fit_attention
from llmaccel.ir import is_op, op_nodes, positions, probe, replace_weight, weight_of


@dataclass
class GQAConfig(FitOptions):
    kv_heads: int = 1
    method: Literal["mean", "cluster", "pca"] = "pca"
    calib_samples: int = 8
    calib_seq_len: int = 256
    # with fit=true: Adam steps per layer fitting the merged W_q, W_k, W_v (and W_o) to the
    # attention block's output (passes/gqa_fit.py; 0: only W_o is refitted) and their learning
    # rate (relative to each weight's RMS)
    fit_qkv_steps: int = 150
    fit_qkv_lr: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        if self.kv_heads < 1:
            raise LlmaccelError(f"gqa.kv_heads must be positive, got {self.kv_heads}")
        if self.calib_samples < 1 or self.calib_seq_len < 2:
            raise LlmaccelError("gqa.calib_samples and gqa.calib_seq_len must be positive")
        if self.fit_qkv_steps < 0 or self.fit_qkv_lr <= 0:
            raise LlmaccelError("gqa.fit_qkv_steps must be >= 0 and gqa.fit_qkv_lr positive")


def _linear_of(node: torch.fx.Node, what: str, att: torch.fx.Node) -> torch.fx.Node:
    if is_op(node, ops.rope):
        node = node.args[0]
    if not is_op(node, ops.linear):
        raise LlmaccelError(f"gqa: layer {att.kwargs['layer']}'s {what} is not a float linear "
                            "(quantized?); run gqa before quant")
    return node


def _site(att: torch.fx.Node) -> dict:
    q, k, v = (_linear_of(n, w, att) for n, w in zip(att.args[:3], "qkv"))
    outs = [u for u in att.users if is_op(u, ops.linear) and u.args[0] is att]
    if len(outs) != 1 or len(att.users) != 1:
        raise LlmaccelError(f"gqa: layer {att.kwargs['layer']}'s attention output is not read by "
                            "one linear; run gqa before passes that rewrite it")
    return {"att": att, "q": q, "k": k, "v": v, "o": outs[0], "rope": is_op(att.args[1], ops.rope)}


def _wb(gm, lin: torch.fx.Node) -> tuple[torch.Tensor, torch.Tensor | None]:
    b = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
    return weight_of(gm, lin.args[1]), weight_of(gm, b)


@torch.no_grad()
def _collect(gm, sites, ids: torch.Tensor) -> list[dict]:
    """Pre-RoPE q, k and v of every attention on ids, as (tokens, features) fp32."""
    vals = probe(gm, [s[w] for s in sites for w in "qkv"])(ids, positions(ids), None)
    return [{w: vals[3 * i + j].flatten(0, 1).float() for j, w in enumerate("qkv")}
            for i in range(len(sites))]


def _groups(acts: dict | None, Hkv: int, G: int, hd: int, similar: bool) -> list[list[int]]:
    n = Hkv // G
    if not similar or acts is None:
        return [list(range(g * G, (g + 1) * G)) for g in range(n)]
    # Cosine similarity of heads' K and V outputs, then greedy balanced grouping.
    feats = []
    for j in range(Hkv):
        f = torch.cat([acts["k"][:, j * hd:(j + 1) * hd].flatten(), acts["v"][:, j * hd:(j + 1) * hd].flatten()])
        feats.append(f / f.norm().clamp_min(1e-12))
    sim = torch.stack(feats) @ torch.stack(feats).T
    left, groups = set(range(Hkv)), []
    while left:
        seed = min(left)
        left.remove(seed)
        grp = [seed]
        while len(grp) < G:
            best = max(left, key=lambda c: sum(sim[c, m].item() for m in grp))
            grp.append(best)
            left.remove(best)
        groups.append(grp)
    return groups


def _pca_v(vs: torch.Tensor, hd: int) -> torch.Tensor:
    """Top-hd principal directions (uncentred, like the linear map) of stacked values (N, G*hd)."""
    cov = vs.double().T @ vs.double()
    _, vecs = torch.linalg.eigh(cov)
    return vecs[:, -hd:].flip(-1)  # (G*hd, hd)


def _complex(x: torch.Tensor, hd: int) -> torch.Tensor:
    """(..., hd) rotate-half layout -> (..., hd/2) complex: pair (i, i + hd/2)."""
    return torch.complex(x[..., : hd // 2].double(), x[..., hd // 2:].double())


def _cmul_rows(w: torch.Tensor, c: torch.Tensor, hd: int) -> torch.Tensor:
    """Rows of a (hd, ...) projection whose output, as complex pairs, is multiplied by c (hd/2,)."""
    a, b = c.real[:, None].to(w.dtype), c.imag[:, None].to(w.dtype)
    if w.dim() == 1:
        a, b = a[:, 0], b[:, 0]
    w1, w2 = w[: hd // 2], w[hd // 2:]
    return torch.cat([a * w1 - b * w2, a * w2 + b * w1], 0)


class GQA(Pass):
    name = "gqa"
    before = ("quant", "bitlinear", "kvquant", "sla")  # it reads plain linears and attention ops
    summary = "merge KV heads (mean-pool, similarity clusters or PCA fit), KV cache bytes cut"
    exact = False
    config_cls = GQAConfig

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        atts = op_nodes(gm, ops.attention)
        if not atts:
            raise LlmaccelError("gqa: the graph has no attention op")
        kw = atts[0].kwargs
        H, Hkv, hd = kw["n_heads"], kw["n_kv_heads"], kw["head_dim"]
        if c.kv_heads > Hkv or Hkv % c.kv_heads:
            raise LlmaccelError(f"gqa.kv_heads={c.kv_heads} must divide the model's {Hkv} KV heads")
        if c.kv_heads == Hkv:
            return PassResult(gm, 0, {"kv_heads_before": Hkv, "kv_heads_after": Hkv})
        orig = snapshot(gm) if c.fit else None
        # A fused graph's q/k/v are one linear: split it for the merge, fuse it again after.
        with unfused(gm) as split:
            atts = op_nodes(gm, ops.attention)
            sites = [_site(a) for a in atts]
            acts = None
            if c.method != "mean":
                ids = ctx.calib_tokens(c.calib_samples, c.calib_seq_len).to(ctx.device)
                acts = _collect(gm, sites, ids)
            for i, s in enumerate(sites):
                self._merge(gm, s, acts[i] if acts else None, H, Hkv, hd)
            elem = weight_of(gm, sites[0]["k"].args[1]).element_size()
            per_tok = lambda n: 2 * len(sites) * n * hd * elem  # noqa: E731  K and V, every layer
            stats = {"fused_groups_split_and_refused": split,
                     "kv_heads_before": Hkv, "kv_heads_after": c.kv_heads, "method": c.method,
                     "kv_bytes_per_token_before": per_tok(Hkv),
                     "kv_bytes_per_token_after": per_tok(c.kv_heads)}
            if c.fit:  # on the unfused graph: the K/V fit rewrites the k and v linears
                stats["fit"] = fit_attention(gm, ctx, c, orig, op_nodes(gm, ops.attention), "gqa fit")
        if ctx.config is not None:
            ctx.config.n_kv_heads = c.kv_heads  # the graph now caches kv_heads heads per layer
        return PassResult(gm, len(sites), stats)

    def _merge(self, gm, s: dict, acts: dict | None, H: int, Hkv: int, hd: int) -> None:
        c = self.config
        G, qpk = Hkv // c.kv_heads, H // Hkv  # kv heads per group, query heads per kv head
        groups = _groups(acts, Hkv, G, hd, similar=c.method != "mean")
        wq, bq = _wb(gm, s["q"])
        wk, bk = _wb(gm, s["k"])
        wv, bv = _wb(gm, s["v"])
        wo, bo = _wb(gm, s["o"])
        blk = lambda t, j: t[j * hd:(j + 1) * hd]  # noqa: E731  rows of kv head j
        new = {"q": [], "bq": [], "k": [], "bk": [], "v": [], "bv": [], "o": []}
        for grp in groups:
            qheads = [h for j in grp for h in range(j * qpk, (j + 1) * qpk)]
            if c.method == "pca":
                k_rows, bk_rows, q_fix = self._fit_k(acts, grp, qpk, hd, wk, bk, s["rope"])
                v_rows, bv_rows, U = self._fit_v(acts, grp, hd, wv, bv)
                o_fix = lambda ow, j, U=U: ow @ U[j]  # noqa: E731  W_o[:, h] v_j ~ W_o[:, h] U_j v'
            else:
                k_rows = torch.stack([blk(wk, j) for j in grp]).mean(0)
                bk_rows = None if bk is None else torch.stack([blk(bk, j) for j in grp]).mean(0)
                v_rows = torch.stack([blk(wv, j) for j in grp]).mean(0)
                bv_rows = None if bv is None else torch.stack([blk(bv, j) for j in grp]).mean(0)
                q_fix = o_fix = None
            for h in qheads:
                j = h // qpk
                qw, qb = blk(wq, h), None if bq is None else blk(bq, h)
                ow = wo[:, h * hd:(h + 1) * hd]
                if q_fix is not None:
                    qw = q_fix(qw, j)
                    qb = None if qb is None else q_fix(qb, j)
                if o_fix is not None:
                    ow = o_fix(ow, j)
                new["q"].append(qw)
                new["bq"].append(qb)
                new["o"].append(ow)
            new["k"].append(k_rows)
            new["bk"].append(bk_rows)
            new["v"].append(v_rows)
            new["bv"].append(bv_rows)
        self._write(gm, s, new, c.kv_heads)

    def _fit_k(self, acts, grp, qpk, hd, wk, bk, rope):
        if not rope:
            rows, brows, U = self._fit_v({"v": acts["k"]}, grp, hd, wk, bk)
            # k ~ U_j k': q.k ~ (U_j^T q).k', so head j's W_q rows (and bias) become U_j^T W_q
            return rows, brows, lambda t, j: U[j].T @ t
        ks = torch.stack([_complex(acts["k"][:, j * hd:(j + 1) * hd], hd) for j in grp], -1)  # N,F,G
        qn = torch.stack([_complex(acts["q"][:, h * hd:(h + 1) * hd], hd).abs().pow(2).mean(0)
                          for j in grp for h in range(j * qpk, (j + 1) * qpk)]).view(len(grp), qpk, -1).mean(1)
        w = qn.T.clamp_min(1e-12)  # F, G: how much each head's key error costs in scores
        kt = ks * w.sqrt()
        cov = torch.einsum("nfg,nfh->fgh", kt, kt.conj())  # F, G, G: E[z z^H] per frequency
        _, vecs = torch.linalg.eigh(cov)
        v = vecs[..., -1]  # F, G top eigenvector: k_j ~ u_j k', k' = sum_j conj(v_j) sqrt(w_j) k_j
        u = v / w.sqrt()
        coef = (v.conj() * w.sqrt())  # F, G
        rows = sum(_cmul_rows(wk[j * hd:(j + 1) * hd].double(), coef[:, i], hd) for i, j in enumerate(grp))
        brows = None if bk is None else sum(_cmul_rows(bk[j * hd:(j + 1) * hd].double(), coef[:, i], hd)
                                            for i, j in enumerate(grp))
        idx = {j: i for i, j in enumerate(grp)}
        # score Re(q conj(k_j)) ~ Re(q conj(u_j) conj(k')): query rows absorb conj(u_j)
        fix = lambda t, j: _cmul_rows(t.double(), u[:, idx[j]].conj(), hd).to(t.dtype)  # noqa: E731
        dt = wk.dtype
        return rows.to(dt), None if brows is None else brows.to(dt), fix

    def _fit_v(self, acts, grp, hd, wv, bv):
        vs = torch.cat([acts["v"][:, j * hd:(j + 1) * hd] for j in grp], 1)
        U = _pca_v(vs, hd).to(wv.dtype)  # (G*hd, hd): v_group ~ U v'
        per_head = {j: U[i * hd:(i + 1) * hd] for i, j in enumerate(grp)}
        stack = torch.cat([wv[j * hd:(j + 1) * hd] for j in grp], 0)
        rows = U.T @ stack
        brows = None if bv is None else U.T @ torch.cat([bv[j * hd:(j + 1) * hd] for j in grp])
        return rows, brows, per_head

    def _write(self, gm, s: dict, new: dict, kv_heads: int) -> None:
        att = s["att"]
        for key, lin, wkey, bkey in (("q", s["q"], "q", "bq"), ("k", s["k"], "k", "bk"), ("v", s["v"], "v", "bv")):
            w = torch.cat(new[wkey], 0).contiguous()
            b = None if new[bkey][0] is None else torch.cat(new[bkey], 0).contiguous()
            w_node = replace_weight(gm, lin.args[1], w, lin)
            b_old = lin.args[2] if len(lin.args) > 2 else None
            b_node = None if b is None else replace_weight(gm, b_old, b, lin)
            lin.args = (lin.args[0], w_node, b_node)
            lin.kwargs = {}
        o = s["o"]
        ow = torch.cat(new["o"], 1).contiguous()
        o.args = (o.args[0], replace_weight(gm, o.args[1], ow, o), *o.args[2:])
        att.kwargs = {**att.kwargs, "n_kv_heads": kv_heads}


PASS = GQA
