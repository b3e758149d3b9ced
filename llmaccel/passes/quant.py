"""quant: weight quantization of the linears (int8 per channel; int4 group-wise, asymmetric), and
int8 activations with int8 weights (act=int8, W8A8: SmoothQuant's migration, then x per row).

Methods: rtn (round to nearest), awq (activation-aware per-input-channel scales folded into the
preceding norm or linear, plus activation-aware clipping), gptq (Hessian-based error
compensation), awq+gptq. Calibrated methods run the graph node by node over the whole
calibration batch (an fx Interpreter): when a linear is reached its real input, produced by the
already-quantized layers before it, is at hand, so AWQ and GPTQ see what inference will see
(GPTQ's "true sequential" order) in one forward. Linears reading one input (q, k, v; gate, up;
or their fused forms) are handled as one group sharing that input's statistics.
The algorithms (grid, AWQ searches, GPTQ, source correction, scale refit) are in
llmaccel/quant/algorithms.py. Storage layout: llmaccel/ops/quant.py and docs/quant-format.md.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.errors import LlmaccelError
from llmaccel.ops import quant as qops
from llmaccel.kernels.gptq import gptq_block
from llmaccel.kernels.int_codes import cpu_bf16_dots
from llmaccel.passes.base import Pass, PassContext, PassResult
from llmaccel.ir import add_weight, is_op, positions, prune_weights, replace_weight, weight_of
from llmaccel.quant.algorithms import (Grid, awq_clip, awq_scale, gptq, refit_scales, smooth_scale,
                                      source_correct)

__all__ = ["PASS", "QuantConfig", "Grid", "awq_clip", "awq_scale", "gptq", "source_correct"]

_GATED = (ops.silu_mul, ops.gelu_mul, ops.relu_mul)
_ADD_NORMS = (ops.add_rms_norm, ops.add_layer_norm)


@dataclass
class QuantConfig:
    bits: Literal[8, 4] = 4
    group_size: Literal[32, 64, 128] = 128   # int4 only; int8 is per output channel
    method: Literal["rtn", "awq", "gptq", "awq+gptq"] = "awq+gptq"
    lm_head: bool = False        # also quantize the LM head (its own copy if tied)
    # Defaults = the best of the W4 g128 sweep on SmolLM2-135M (docs/quality.md): 128 samples
    # with act_order beat 64 without by 3.3 points of perplexity.
    n_samples: int = 128         # calibration sequences (awq, gptq)
    seq_len: int = 512
    act_order: bool = True       # gptq: quantize columns by decreasing Hessian diagonal
    damp: float = 0.01           # gptq: diagonal damping, as a fraction of the mean diagonal
    awq_tokens: int = 512        # tokens sampled from the calibration batch for the AWQ searches
    awq_clip: bool = True        # awq: clip each (row, group) range to the least output error
    gqa_o: bool = True           # awq: scale o after GQA attention too, one scale per KV channel
    # awq: also search AutoAWQ's activation/weight-balanced scales. On SmolLM2 with the mixed
    # calibration it cut KL 12-15% on every domain for ~10 s more on 2 CPU cores (docs/quality.md)
    awq_duo: bool = True
    match_source: bool = False   # calibrated: fit the source model's outputs, not the quantized path's
    range_search: int = 0        # shrink steps searched per group range where AWQ did not clip
    refit: bool = True           # calibrated int4: least-squares group scales for the final codes
    # int8: x rounded to int8 per row too (W8A8), after SmoothQuant's per-channel migration of
    # strength `smooth` (its scaling replaces AWQ's); on SmolLM2 alpha 0.65 beat 0.5 and 0.8
    act: Literal["none", "int8"] = "none"
    smooth: float = 0.65

    def __post_init__(self):
        if self.bits not in (8, 4):
            raise LlmaccelError(f"quant.bits={self.bits}: supported bits are 8 and 4")
        if self.group_size not in (32, 64, 128):
            raise LlmaccelError(f"quant.group_size={self.group_size}: supported sizes are 32, 64, 128")
        if self.method not in ("rtn", "awq", "gptq", "awq+gptq"):
            raise LlmaccelError(f"quant.method={self.method}: expected rtn, awq, gptq or awq+gptq")
        if self.range_search < 0:
            raise LlmaccelError(f"quant.range_search={self.range_search}: must be 0 or more")
        for k in ("n_samples", "seq_len", "awq_tokens"):
            if getattr(self, k) < 1:
                raise LlmaccelError(f"quant.{k}={getattr(self, k)}: must be positive")
        if self.act not in ("none", "int8"):
            raise LlmaccelError(f"quant.act={self.act}: expected none or int8")
        if self.act == "int8" and self.bits != 8:
            raise LlmaccelError("quant.act=int8 needs quant.bits=8 (int8 weights with int8 activations)")
        if not 0 <= self.smooth <= 1:
            raise LlmaccelError(f"quant.smooth={self.smooth}: expected a value in [0, 1]")
        if not 0 < self.damp < 1:
            raise LlmaccelError(f"quant.damp={self.damp}: expected a value in (0, 1)")


# --- finding where an AWQ scale can be folded ----------------------------------------------------

def _rows_source(node):
    """(linear node, row slice) producing `node`: a linear itself or one part of a fused split."""
    if is_op(node, ops.linear, qops.linear_int4, qops.linear_int8):
        return node, None
    if is_op(node, operator.getitem) and isinstance(node.args[0], torch.fx.Node):
        sp = node.args[0]
        if sp.op == "call_method" and sp.target == "split" and isinstance(sp.args[1], (list, tuple)):
            lin, sizes, i = sp.args[0], list(sp.args[1]), node.args[1]
            if is_op(lin, ops.linear) and sp.kwargs.get("dim", -1) in (-1, 2) and len(sp.users) >= 1:
                start = sum(sizes[:i])
                return lin, slice(start, start + sizes[i])
    return None, None


def find_sink(xnode, group, n_heads: int, n_kv_heads: int, gqa_o: bool = True):
    """Where 1/s can be folded for linears `group` reading xnode: ('norm', node, w_idx, b_idx),
    ('rows', linear, slice, tie), or a reason string when it cannot. tie = (n_kv_heads,
    heads per KV head) when o reads GQA attention: o channels of heads sharing a KV head come
    from one v channel, so their scales must be equal (then folded once into v's row)."""
    if set(xnode.users) - set(group):
        return "input has other readers"
    if is_op(xnode, ops.rms_norm):
        return ("norm", xnode, 1, None)
    if is_op(xnode, ops.layer_norm):
        return ("norm", xnode, 1, 2)
    if is_op(xnode, operator.getitem) and is_op(xnode.args[0], *_ADD_NORMS) and xnode.args[1] == 0:
        n = xnode.args[0]
        return ("norm", n, 2, 3 if n.target is ops.add_layer_norm else None)
    tie = None
    if is_op(xnode, *_GATED):
        src = xnode.args[1]
    elif is_op(xnode, ops.attention):
        if n_heads != n_kv_heads:
            if not gqa_o:
                return "o after GQA attention"
            tie = (n_kv_heads, n_heads // n_kv_heads)
        src = xnode.args[2]
    else:
        return f"input is {getattr(xnode.target, '__name__', xnode.target)}"
    if len(src.users) != 1:
        return "producer has other readers"
    lin, rows = _rows_source(src)
    return ("rows", lin, rows, tie) if lin is not None else "no linear producer"


# --- the calibration's large products ------------------------------------------------------------

def _bf16_products(x: torch.Tensor) -> bool:
    """Whether the calibration's two large products run in bf16 with fp32 sums: fp32 inputs on a
    CPU that multiplies bf16 in hardware (the CPU decode path runs these linears in bf16 too). On
    2 AVX512-BF16 cores they are ~2x faster and were over half of the default W4 compile
    (docs/performance.md, CPU). A GPU calibrates a bf16 model, whose inputs are bf16 already."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_bf16_dots()


def _linear(x, w, b):
    """A quantized linear's output on the calibration batch, which feeds the layers after it."""
    if not _bf16_products(x):
        return F.linear(x, w, b)
    return F.linear(x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()).float()


def _gram(xs: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """H = xsᵀ xs over every calibration token (GPTQ's Hessian, the refit's metric). In bf16 it is
    summed in fp32 over chunks of tokens, so each chunk's product is rounded once: off by < 0.1%
    of sqrt(H_ii H_jj) against float64 where fp32 is 1e-6. That can leave a near-singular H
    indefinite: GPTQ then takes the fp32 one (`fp32_hessians` in the stats)."""
    if not _bf16_products(xs):
        return xs.T @ xs
    H = torch.zeros(xs.shape[1], xs.shape[1], dtype=torch.float32, device=xs.device)
    for c in xs.split(chunk):
        cb = c.bfloat16()
        H += (cb.T @ cb).float()
    return H


# --- the pass ------------------------------------------------------------------------------------

class _Calibrated(torch.fx.Interpreter):
    """Runs the graph on the calibration batch, quantizing each group of linears when reached.

    With `source`, it also carries the source model's values of every node (`fenv`: the same
    nodes run on source values; the graph keeps its float weights until the final rewrite), so
    each group can be fitted to the source outputs."""

    def __init__(self, gm, quantizer, source: bool = False):
        super().__init__(gm)
        self.q, self.outputs = quantizer, {}
        self.fenv = {} if source else None

    def run_node(self, n):
        if not self.q.pending and n not in self.outputs:  # all quantized: skip the rest
            return None
        val = self._run_quantized(n)
        if self.fenv is not None:
            if n.op in ("placeholder", "get_attr"):
                self.fenv[n] = val
            else:
                env, self.env = self.env, self.fenv
                try:
                    self.fenv[n] = super().run_node(n)
                finally:
                    self.env = env
            for dead in self.user_to_last_uses.get(n, []):
                self.fenv.pop(dead, None)
        return val

    def _run_quantized(self, n):
        if n in self.outputs:
            return self.outputs.pop(n)
        if n in self.q.pending:
            x_src = None if self.fenv is None else self.fenv[n.args[0]]
            self.q.process(n, self.env[n.args[0]], self.outputs, x_src)
            return self.outputs.pop(n, None)
        return super().run_node(n)


class _Quantizer:
    def __init__(self, gm, cfg: QuantConfig, model_cfg, bar):
        self.gm, self.cfg, self.mc, self.bar = gm, cfg, model_cfg, bar
        self.pending: set = set()
        self.records: dict = {}       # linear node -> codes, scale, zero, bias, grid, K
        self.norm_scales: dict = {}   # norm node -> (weight index, bias index, 1/s, name)
        self.awq_skipped: dict = {}
        self.fp32_hessians = 0        # groups whose bf16 Hessian was not positive definite
        self.gen = torch.Generator().manual_seed(0)

    def grid(self, K: int, search: bool = True) -> Grid:
        if self.cfg.bits == 8:
            return Grid(8, K)
        return Grid(4, self.cfg.group_size, self.cfg.range_search if search else 0)

    def process(self, node, x, outputs=None, x_src=None) -> None:
        """Quantize every pending linear reading node's input; put their outputs in `outputs`."""
        self._process(node, x, outputs, x_src)

    def _process(self, node, x, outputs, x_src) -> None:
        c, xnode = self.cfg, node.args[0]
        group = [u for u in xnode.users if u in self.pending]
        ws = [weight_of(self.gm, u.args[1]).float() for u in group]
        K = ws[0].shape[1]
        grid = self.grid(K)
        stem = group[0].args[1].target.removesuffix(".weight") if group[0].target is ops.linear else "lm_head"
        self.bar.set_postfix_str(stem)
        xs = sub = None
        if x is not None:
            xs = x.reshape(-1, K).float()
            sub = xs[torch.randperm(xs.shape[0], generator=self.gen)[: c.awq_tokens].to(xs.device)]
        if x_src is not None:
            # Float weights that best map the inputs at hand to the source's outputs; all that
            # follows quantizes them (rows are independent: one solve for the group).
            sizes = [w.shape[0] for w in ws]
            ws = list(source_correct(torch.cat(ws), x_src.reshape(-1, K).float(), xs, c.damp).split(sizes))
        smooth = None
        if c.act == "int8":
            s = smooth_scale(xs, ws, c.smooth)
            ws, xs, smooth = [w * s for w in ws], xs / s, 1 / s
        elif "awq" in c.method:
            sink = find_sink(xnode, group, self.mc.n_heads, self.mc.n_kv_heads, c.gqa_o)
            if isinstance(sink, tuple) and (sink[0] == "norm" or sink[1] in self.records):
                s = awq_scale(sub, ws, grid, tie=sink[3] if sink[0] == "rows" else None, duo=c.awq_duo)
                ws = [w * s for w in ws]
                xs, sub = xs / s, sub / s
                self._fold(sink, s, stem)
            else:
                self.awq_skipped[stem] = sink if isinstance(sink, str) else "producer not quantized"
            if c.bits == 4 and c.awq_clip:
                ws = [awq_clip(sub, w, grid) for w in ws]
                # the clip search chose ranges for min/max rounding: keep that rounding
                grid = self.grid(K, search=False)
        self.pending -= set(group)
        q, scale, zero = self._codes(torch.cat(ws, 0), xs, grid)
        start = 0
        for u, w in zip(group, ws):
            rows = slice(start, start + w.shape[0])
            start += w.shape[0]
            b_node = u.args[2] if len(u.args) > 2 else u.kwargs.get("bias")
            b = weight_of(self.gm, b_node)
            self.records[u] = dict(q=q[rows], scale=scale[rows], zero=zero[rows], grid=grid, K=K,
                                   bias_node=b_node, bias=None if b is None else b.float().clone(),
                                   bias_changed=False, smooth=smooth)
        self.bar.update(1)
        if outputs is None or not self.pending:
            return
        for u in group:
            r = self.records[u]
            w = grid.dequant(r["q"], r["scale"], r["zero"], K)
            xq = xs if smooth is None else qops.round_rows_int8(xs)
            outputs[u] = _linear(xq.view(*x.shape[:-1], K), w, r["bias"]).to(x.dtype)

    def _codes(self, w_all, xs, grid):
        """(codes, scales, zeros) of a group's rows, which are independent given H: one GPTQ (or
        RTN) call for the whole group."""
        c = self.cfg
        full = "gptq" in c.method or (c.refit and c.bits == 4)  # else only H's diagonal is read
        H = None if xs is None or not full else _gram(xs)
        if "gptq" in c.method:
            try:
                q, scale, zero = self._gptq(w_all, H, grid)
            except torch.linalg.LinAlgError:
                if not _bf16_products(xs):
                    raise
                # bf16 sums can leave a near-singular H (e.g. a first layer's attention
                # output) indefinite even after damping, where fp32 ones do not
                self.fp32_hessians += 1
                H = xs.T @ xs
                q, scale, zero = self._gptq(w_all, H, grid)
        else:
            # the int4 range search weighs columns by H's diagonal; int8's ranges are absmax
            diag = None if xs is None or c.bits == 8 else xs.float().pow(2).sum(0) if H is None \
                else H.diagonal()
            scale, zero = grid.params(w_all, diag)
            q = grid.codes(w_all, scale, zero)
        if c.refit and H is not None and c.bits == 4:
            scale = refit_scales(w_all, H, q, scale, zero, grid)
        return q, scale, zero

    def _gptq(self, w, H, grid):
        return gptq(w, H, grid, act_order=self.cfg.act_order, damp=self.cfg.damp, block_fn=gptq_block)

    def _fold(self, sink, s: torch.Tensor, stem: str) -> None:
        if sink[0] == "norm":
            _, norm, wi, bi = sink
            prev = self.norm_scales.get(norm)
            inv = 1 / s if prev is None else prev[2] / s
            self.norm_scales[norm] = (wi, bi, inv, stem + ".in_scale")
            return
        _, lin, rows, tie = sink
        if tie is not None:  # s is equal over heads sharing a KV head: one value per v channel
            n_kv, rep = tie
            s = s.view(n_kv, rep, -1)[:, 0].reshape(-1)
        r = self.records[lin]
        rows = rows or slice(0, r["scale"].shape[0])
        # Scaling output rows of an already quantized linear is exact: it scales the row's scales.
        r["scale"][rows] = r["scale"][rows] / s[:, None]
        if r["bias"] is not None:
            r["bias"][rows] = r["bias"][rows] / s
            r["bias_changed"] = True

    def rewrite(self) -> None:
        gm = self.gm
        for norm, (wi, bi, inv, name) in self.norm_scales.items():
            w_node = norm.args[wi]
            if w_node is None:  # `fuse` folded the norm's scale away: the norm gets one again
                new = add_weight(gm, name, inv.to(self._dtype()), norm)
            else:
                w = weight_of(gm, w_node)
                new = replace_weight(gm, w_node, (w.float() * inv).to(w.dtype), norm)
            norm.update_arg(wi, new)
            if bi is not None and norm.args[bi] is not None:
                b = weight_of(gm, norm.args[bi])
                norm.update_arg(bi, replace_weight(gm, norm.args[bi], (b.float() * inv).to(b.dtype), norm))
        for node, r in self.records.items():
            self._rewrite_linear(node, r)

    def _dtype(self) -> torch.dtype:
        return next(iter(self.gm.parameters())).dtype

    def _rewrite_linear(self, node, r) -> None:
        gm, g, grid = self.gm, self.gm.graph, r["grid"]
        dt = weight_of(gm, node.args[1]).dtype
        stem = node.args[1].target.removesuffix(".weight") if node.target is ops.linear else "lm_head"
        N = r["q"].shape[0]
        b_node = r["bias_node"]
        if r["bias_changed"]:
            b_node = replace_weight(gm, b_node, r["bias"].to(dt), node)
        x = node.args[0]
        if grid.bits == 8:
            qw = add_weight(gm, stem + ".qweight", r["q"].to(torch.int8), node)
            sc = add_weight(gm, stem + ".scales", r["scale"][:, 0].to(dt), node)
            target, args, kw = qops.linear_int8, (x, qw, sc, b_node), {}
            if r["smooth"] is not None:
                sm = add_weight(gm, stem + ".smooth", r["smooth"].float(), node)
                target, args = qops.linear_w8a8, (x, qw, sc, sm, b_node)
        else:
            packed = qops.pack_int4(r["q"].reshape(N, -1, grid.gs).to(torch.uint8))
            qw = add_weight(gm, stem + ".qweight", packed, node)
            sc = add_weight(gm, stem + ".scales", r["scale"].to(dt), node)
            zr = add_weight(gm, stem + ".zeros", qops.pack_zeros(r["zero"].to(torch.uint8)), node)
            target, args, kw = qops.linear_int4, (x, qw, sc, zr, b_node), {"group_size": grid.gs}
        with g.inserting_before(node):
            new = g.call_function(target, args, kw)
        node.replace_all_uses_with(new)
        g.erase_node(node)


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class Quant(Pass):
    name = "quant"
    summary = ("weight quantization: int8 per channel; int4 group-wise (RTN, AWQ, GPTQ, AWQ+GPTQ); "
               "W8A8 with act=int8")
    exact = False
    config_cls = QuantConfig

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        c = self.config
        targets = [n for n in gm.graph.nodes if is_op(n, ops.linear) or (c.lm_head and is_op(n, ops.lm_head))]
        if not targets:
            return PassResult(gm, 0, {"quantized": 0})
        n_groups = len({n.args[0] for n in targets})
        # the calibration text first: its sampling has a bar of its own, and this one's rate and
        # time left count the quantization only
        calibrated = c.method != "rtn" or c.act == "int8"  # smoothing reads the activations
        ids = ctx.calib_tokens(c.n_samples, c.seq_len).to(ctx.device) if calibrated else None
        bar = ctx.progress(None, desc=f"quant {c.method} w{c.bits}", total=n_groups, unit="group")
        qz = _Quantizer(gm, c, ctx.config, bar)
        qz.pending, qz.n_groups = set(targets), n_groups
        fp_bytes = sum(_nbytes(weight_of(gm, n.args[1])) for n in targets)
        if ids is None:
            for n in targets:
                if n in qz.pending:
                    qz.process(n, None)
        else:
            with torch.no_grad():
                _Calibrated(gm, qz, source=c.match_source).run(ids, positions(ids), None)
        bar.close()
        qz.rewrite()
        prune_weights(gm)
        return PassResult(gm, len(targets), self._stats(gm, qz, fp_bytes, targets))

    def _stats(self, gm, qz, fp_bytes, targets) -> dict:
        c = self.config
        q_bytes = 0
        for n in gm.graph.nodes:
            if is_op(n, qops.linear_int4, qops.linear_int8, qops.linear_w8a8):
                stored = n.args[1:4] if n.target in (qops.linear_int4, qops.linear_w8a8) else n.args[1:3]
                q_bytes += sum(_nbytes(weight_of(gm, a)) for a in stored)
        n_weights = sum(r["q"].shape[0] * r["K"] for r in qz.records.values())
        padded = sorted({r["K"] for r in qz.records.values() if r["K"] % r["grid"].gs})
        st = {"bits": c.bits, "act": c.act, "method": c.method, "quantized": len(targets),
              "bytes_per_weight": round(q_bytes / n_weights, 4),
              "size_ratio_vs_source": round(fp_bytes / q_bytes, 2)}
        if c.bits == 4:
            st["group_size"] = c.group_size
        if qz.fp32_hessians:
            st["fp32_hessians"] = qz.fp32_hessians
        if padded:
            st["padded_in_features"] = padded  # last group of these layers is partial (zero-padded)
        if c.act == "int8":
            st["smooth"] = c.smooth
        elif "awq" in c.method:
            st["awq_scaled"] = qz.n_groups - len(qz.awq_skipped)
            reasons: dict = {}
            for why in qz.awq_skipped.values():
                reasons[why] = reasons.get(why, 0) + 1
            st["awq_skipped"] = reasons
        return st


PASS = Quant
