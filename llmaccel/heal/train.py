"""The heal pass's training step: precision, compiled forwards and a chunked KL head.

Precision (`heal.dtype`). `bfloat16` runs the teacher's forward and the student's forward and
backward under torch.autocast: matmuls and attention in bf16 with fp32 accumulation, while the
ops that upcast in their reference (norms, softmax statistics, the SLA state, fake-quantization
of bitlinear) keep doing so. The trained weights are fp32 master weights that AdamW updates in
fp32: a trainable weight held in a lower precision (a model loaded in bf16) is raised to fp32 for
the heal and cast back at the end, so small updates are not rounded away. `float32` computes in
the weights' dtype (TF32 matmuls), as the heal always did. auto: bfloat16 on CUDA, else float32.

Compilation (`heal.compile`). The student's and the teacher's forwards are compiled with
torch.compile(fullgraph=True): the IR ops are plain PyTorch (attention is
F.scaled_dot_product_attention with is_causal when there is no cache), so each forward is one
graph, and AOTAutograd compiles the student's backward. The passes' training forms are moved by
0-dim buffers that heal_schedule fills in place; buffers are graph inputs, so a step never
recompiles. auto: inductor on CUDA, off elsewhere (Inductor on a CPU needs a C++ compiler and
about a minute per graph; `aot_eager` traces and differentiates the same graphs without
generating code). When auto's compilation fails the step runs eagerly and the stats say so.

KL head. The loss needs log-softmax over the vocabulary for every token of the batch, twice
(student and teacher). The student's and teacher's forwards stop at the input of their
lm_head; `chunked_kl` applies the heads `kl_chunk` rows at a time and computes each chunk's
gradient as it goes (d KL / d logits = softmax(s) - softmax(t)), so only one chunk of (rows,
vocab) logits exists at a time, and no logits are kept for the backward. A graph whose head
is not a plain lm_head (a quantized one) hands over its logits, which are then chunked alike.
"""
from __future__ import annotations

import contextlib
import copy
import operator
from typing import NamedTuple

import torch
import torch.fx
import torch.nn.functional as F

from llmaccel import ops
from llmaccel.config import ModelConfig
from llmaccel.errors import LlmaccelError
from llmaccel.ir import is_op, positions, weight_of
from llmaccel.heal.regions import regional
from llmaccel.ops.rope import rope_at, rope_inv_freq

_GPU_TOKENS = 16384   # training tokens per step on CUDA unless memory bounds it
_GPU_SEQ = 512


class Head(NamedTuple):
    """The lm_head a view stops before (weight None: the view returns logits)."""
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def resolve_dtype(name: str, device: str, weights=()) -> torch.dtype | None:
    """The autocast dtype, or None for no autocast. float32 computes in the weights' dtype:
    weights (the trained ones) below fp32 are raised to fp32 masters for training, so in a bf16
    model the frozen ones would meet them in bf16 (a matmul of mixed dtypes fails): autocast to
    the weights' own dtype then."""
    if name == "auto":
        name = "bfloat16" if str(device).startswith("cuda") else "float32"
    if name == "bfloat16":
        return torch.bfloat16
    return next((w.dtype for w in weights if w.is_floating_point() and w.dtype != torch.float32), None)


def resolve_backend(name: str, device: str) -> str | None:
    if name == "auto":
        return "inductor" if str(device).startswith("cuda") else None
    return None if name == "off" else name


def act_bytes_per_token(cfg: ModelConfig) -> int:
    """A generous bound on the activations one training token keeps for the backward (bf16,
    the residual stream in fp32): ~16 hidden-sized and 5 MLP-sized values per layer."""
    return cfg.n_layers * (16 * cfg.hidden_size + 5 * cfg.intermediate_size) * 2


def auto_shape(cfg: ModelConfig, device: str, seq_len: int, batch: int) -> tuple[int, int]:
    """(seq_len, batch) with 0 = auto: on CUDA 512-token windows and ~16k tokens per step,
    fewer when that would take more than half the free memory; elsewhere 64 x 2."""
    cuda = str(device).startswith("cuda")
    seq_len = seq_len or (min(_GPU_SEQ, cfg.max_position) if cuda else 64)
    if batch:
        return seq_len, batch
    if not cuda:
        return seq_len, 2
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    tokens = min(_GPU_TOKENS, free // 2 // act_bytes_per_token(cfg))
    return seq_len, max(1, tokens // seq_len)


@contextlib.contextmanager
def master_weights(params: dict[str, torch.nn.Parameter]):
    """Trainable weights in fp32 for the duration (same Parameter objects, so views and tied
    readers follow), back in their own dtype afterwards."""
    was = {name: p.dtype for name, p in params.items()}
    for p in params.values():
        if p.dtype != torch.float32:
            p.data = p.data.float()
    try:
        yield
    finally:
        for name, p in params.items():
            if p.dtype != was[name]:
                p.data = p.data.to(was[name])


def _plain_head(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Head | None:
    args = list(node.args) + [node.kwargs.get("bias")] * (len(node.args) < 3)
    w, b = args[1], args[2]
    ok = all(a is None or (isinstance(a, torch.fx.Node) and a.op == "get_attr") for a in (w, b))
    if not ok or w is None:
        return None
    head = Head(weight_of(gm, w), weight_of(gm, b))
    return head if all(t is None or t.is_floating_point() for t in head) else None


def residual_before_norm(g: torch.fx.Graph, head: torch.fx.Node) -> torch.fx.Node:
    """The residual stream that feeds the final norm (adds a node to g for a fused norm)."""
    x = head.args[0]
    if is_op(x, operator.getitem) and is_op(x.args[0], ops.add_rms_norm, ops.add_layer_norm):
        fused = x.args[0]
        with g.inserting_after(fused):
            return g.call_function(operator.add, (fused.args[0], fused.args[1]))
    if is_op(x, ops.rms_norm, ops.layer_norm):
        return x.args[0]
    return x  # a norm some pass replaced: compare its output instead


def heal_view(gm: torch.fx.GraphModule, hidden: bool) -> tuple[torch.fx.GraphModule, Head]:
    """A module sharing gm's weights that returns (lm_head input[, residual before the final
    norm]) and the head it stopped before; logits and Head(None, None) when the head is not a
    plain lm_head."""
    g = copy.deepcopy(gm.graph)
    heads = [n for n in g.nodes if is_op(n, ops.lm_head)]
    out = next(n for n in g.nodes if n.op == "output")
    head = _plain_head(gm, heads[0]) if len(heads) == 1 else None
    outs = [heads[0].args[0] if head else out.args[0]]
    if hidden:
        if len(heads) != 1:
            raise LlmaccelError("heal.hidden needs a graph with exactly one lm_head")
        outs.append(residual_before_norm(g, heads[0]))
    out.args = (tuple(outs),)
    g.eliminate_dead_code()
    g.lint()
    view = torch.fx.GraphModule(gm, g, class_name="heal_view")
    _rope_frequencies_once(view, next(gm.parameters()).device)
    return view, head or Head(None, None)


def _rope_frequencies_once(view: torch.fx.GraphModule, device) -> None:
    """ops.rope computes its frequencies on the host at every call and copies them over, which
    in a compiled CUDA step is a host-side kernel and a synchronizing copy per layer: here they
    are buffers on the device, computed once (the same values), and read by rope_at."""
    names: dict[tuple, str] = {}
    for n in list(view.graph.nodes):
        if not is_op(n, ops.rope):
            continue
        kw = n.kwargs
        key = (kw["head_dim"], kw["theta"], repr(kw.get("scaling")))
        if key not in names:
            names[key] = f"_heal_rope{len(names)}"
            view.register_buffer(names[key], rope_inv_freq(kw["head_dim"], kw["theta"],
                                                           kw.get("scaling")).to(device))
        with view.graph.inserting_before(n):
            freq = view.graph.get_attr(names[key])
        n.target, n.args, n.kwargs = rope_at, (*n.args[:2], freq), {"head_dim": kw["head_dim"]}
    view.recompile()


def kl_rows(s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of KL(softmax t || softmax s) and its gradient with respect to s (fp32).
    The gradient is log-softmax's backward as autograd computes it: softmax(s) * sum(p_t) - p_t."""
    ls = s.float().log_softmax(-1)
    lt = t.float().log_softmax(-1)
    pt = lt.exp()
    return (pt * (lt - ls)).sum(), ls.exp() * pt.sum(-1, keepdim=True) - pt


def _in_dtype(head: Head, h: torch.Tensor, dtype: torch.dtype | None) -> Head:
    """The head in the dtype its matmul runs in (cast once, not once per chunk)."""
    if head.weight is None:
        return head
    cd = dtype or torch.promote_types(h.dtype, head.weight.dtype)
    return Head(*(None if t is None else t.to(cd) for t in head))


def _logits(h: torch.Tensor, head: Head) -> torch.Tensor:
    if head.weight is None:
        return h
    return F.linear(h.to(head.weight.dtype), head.weight, head.bias)


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, w, b, ht, t_head, chunk, dtype, rows_fn):
        head, t_head = _in_dtype(Head(w, b), hs, dtype), _in_dtype(t_head, ht, dtype)
        n = hs.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(hs) if need_h else None
        gw = torch.zeros_like(w, dtype=torch.float32) if need_w else None
        gb = torch.zeros_like(b, dtype=torch.float32) if need_b else None
        total = hs.new_zeros((), dtype=torch.float32)
        with torch.autocast(hs.device.type, enabled=False):
            for i in range(0, n, chunk):
                h = hs[i: i + chunk]
                loss, g = rows_fn(_logits(h, head), _logits(ht[i: i + chunk], t_head))
                total += loss
                g = g / n
                if w is None:
                    if need_h:
                        gh[i: i + chunk] = g
                    continue
                gc = g.to(head.weight.dtype)
                if need_h:
                    gh[i: i + chunk] = gc @ head.weight
                if need_w:
                    gw += (gc.T @ h.to(gc.dtype)).float()
                if need_b:
                    gb += g.sum(0)
        ctx.save_for_backward(*(t for t in (gh, gw, gb) if t is not None))
        ctx.which = (need_h, need_w, need_b)
        ctx.dtypes = (hs.dtype, None if w is None else w.dtype, None if b is None else b.dtype)
        return total / n

    @staticmethod
    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        out = [(next(saved) * grad).to(dt) if need else None for need, dt in zip(ctx.which, ctx.dtypes)]
        return (*out, None, None, None, None, None)


def chunked_kl(hs: torch.Tensor, s_head: Head, ht: torch.Tensor, t_head: Head, *, chunk: int,
               dtype: torch.dtype | None = None, rows_fn=kl_rows) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) from the lm_head inputs (or logits) hs, ht
    (..., features): equal to kl_loss(head(hs), head(ht)), `chunk` rows at a time (0 = all).
    `dtype`: the heads' matmul dtype (None: the inputs' own)."""
    hs, ht = hs.flatten(0, -2), ht.flatten(0, -2).detach()
    t_head = Head(*(None if t is None else t.detach() for t in t_head))
    return _ChunkedKL.apply(hs, s_head.weight, s_head.bias, ht, t_head,
                            chunk or hs.shape[0], dtype, rows_fn)


def _why(e: Exception) -> str:
    """A compile failure in one line for the report: its type and the start of its message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


class Trainer:
    """One optimizer step of self-distillation: the teacher's and the student's forwards (under
    autocast when `dtype`, compiled when `backend`), the chunked KL (+ hidden-state MSE), AdamW.
    Build it with the weights already as they will train (inside master_weights)."""

    def __init__(self, student: torch.fx.GraphModule, teacher: torch.fx.GraphModule,
                 params: list[torch.nn.Parameter], *, lr: float, hidden: float,
                 dtype: torch.dtype | None, backend: str | None, kl_chunk: int, log=print,
                 regional: bool = False):
        self.hidden, self.dtype, self.chunk, self.log = hidden, dtype, kl_chunk, log
        self.params = params
        self._views = (heal_view(student, bool(hidden)), heal_view(teacher, bool(hidden)))
        self.regional = regional and backend is not None
        self.compile_error: str | None = None
        self._build(backend)
        # a first step that fails to compile falls back to eager once (auto chose compilation)
        self.fallback = backend is not None
        cuda = params[0].device.type == "cuda"
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, **({"fused": True} if cuda else {}))

    def _build(self, backend: str | None) -> None:
        (s, self.s_head), (t, self.t_head) = self._views
        self.rows_fn = kl_rows
        if backend:
            if self.regional:   # each decoder layer traced and compiled once (regions.py)
                try:
                    rs, rt = regional(s), regional(t)
                except Exception as e:  # noqa: BLE001 - cutting the graph failed: the whole graph
                    self.compile_error = _why(e)
                    self.log(f"heal: cutting the graph by layer failed ({self.compile_error}); compiling the whole graph")
                    rs, rt = s, t
                # no layers to share, or a torch without nested compile regions: the whole graph
                self.regional = rs is not s and rt is not t
                if self.regional:
                    s, t = rs, rt
            s = torch.compile(s, backend=backend, fullgraph=True, dynamic=False)
            t = torch.compile(t, backend=backend, fullgraph=True, dynamic=False)
            self.rows_fn = torch.compile(kl_rows, backend=backend, fullgraph=True)
        self.backend, self.student, self.teacher = backend, s, t

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        pos = positions(x)
        amp = torch.autocast(x.device.type, self.dtype) if self.dtype else contextlib.nullcontext()
        with amp:
            with torch.no_grad():
                t_out = self.teacher(x, pos, None)
            s_out = self.student(x, pos, None)
        loss = chunked_kl(s_out[0], self.s_head, t_out[0], self.t_head, chunk=self.chunk,
                          dtype=self.dtype, rows_fn=self.rows_fn)
        if self.hidden:
            s_h, t_h = s_out[1].float(), t_out[1].float()
            loss = loss + self.hidden * F.mse_loss(s_h, t_h) / t_h.pow(2).mean()
        return loss

    def _step(self, x: torch.Tensor, lr: float) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        return loss.detach()

    def step(self, x: torch.Tensor, lr: float) -> torch.Tensor:
        """One step at learning rate `lr`; the loss as a 0-d tensor (not synchronized)."""
        try:
            loss = self._step(x, lr)
        except torch._dynamo.exc.TorchDynamoException as e:
            if not self.fallback:
                raise
            error = _why(e)
            # the first failure (by layer) stays in the report beside the second (whole graph)
            self.compile_error = error if self.compile_error is None else f"{self.compile_error}; then {error}"
            if self.regional:   # the whole graph at once, as without heal.regional
                self.log(f"heal: compiling by layer failed ({self.compile_error}); compiling the whole graph")
                self.regional = False
                self._build(self.backend)
                return self.step(x, lr)
            self.log(f"heal: compilation failed ({self.compile_error}); training eagerly")
            self._build(None)
            loss = self._step(x, lr)
        self.fallback = False
        return loss
