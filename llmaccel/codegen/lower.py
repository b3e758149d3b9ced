"""Lowering: the IR graph -> a graph for fast execution that Dynamo traces whole.

- an IR op `llmaccel.ops...<name>` becomes `torch.ops.llmaccel.<name>` where a kernel module
  registers that custom op and its schema accepts the node's arguments (Triton on CUDA,
  reference on CPU); otherwise the reference op stays and Inductor compiles it
- rope reads cos/sin tables stored on the module (fp32, computed once on the model's device):
  the reference builds its frequencies on the host at every call, and host ops inside the
  traced step would keep CUDA graphs from capturing it
- optionally, linear becomes a reduction `(x * w).sum(-1)`: at one or a few rows Inductor emits
  one GEMV kernel that reads the weight once and fuses the norm before it and the activation or
  residual add after it, where a cuBLAS call is a separate launch; a weightless RMSNorm feeding
  only such a linear (its scale folded into the weight by `fuse`) becomes part of the GEMV
  (`linear_rows_rms`), statistics included
"""
from __future__ import annotations

import functools
import importlib
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from llmaccel import ops
from llmaccel.ir import set_weight, weight_of
from llmaccel.ops.rope import rope_inv_freq, rope_table
from llmaccel.ops.table import OPS, spec_of
from llmaccel.codegen.kernel_ops import accepts, custom_op, load_kernel_modules, retarget
from llmaccel.codegen.gemv_rewrites import gemv_rewrites, int4_gemv_weights
from llmaccel.kernels.int_codes import (int8_mm_cpu, linear_bf16_cpu, prepare_bf16_cpu,
                                        prepare_head_cpu)

def ir_op_name(node: torch.fx.Node) -> str | None:
    spec = spec_of(node.target) if node.op == "call_function" else None
    return None if spec is None else spec.name


@functools.cache
def cpu_forms() -> dict:
    """{IR op name: (prepare, fn)} merged from the kernel modules' CPU_FORMS tables.

    A Python custom op costs ~80 us of dispatch per call on the CPU, more than a batch-1 GEMV
    of a small model; a plain function calling aten ops directly is traced into the compiled
    step and costs nothing extra there.
    """
    forms: dict = {}
    for name, status in load_kernel_modules().items():
        if status == "ok":
            forms.update(getattr(importlib.import_module(f"llmaccel.kernels.{name}"), "CPU_FORMS", {}))
    return forms


def _to_cpu_form(new: torch.fx.GraphModule, node: torch.fx.Node, form, rep,
                 prepared: dict) -> bool:
    """Retarget `node` to a CPU form; whether it was.

    form is (None, fn): fn takes the node's arguments as they are; or (prepare, fn, n): the node
    is (x, w0 .. w{n-1}, bias?) with n stored weights, prepare converts them and fn reads what it
    returns (None: the form does not apply). `prepared` maps the stored weights' names to
    their converted tensors, so several lowerings of one model (prefill, decode) share one copy.
    """
    prepare, fn = form[:2]
    if prepare is None:
        retarget(node, fn)
        return True
    n = form[2]
    stored = node.args[1:1 + n]
    if not all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in stored):
        return False
    key = (prepare, tuple(a.target for a in stored))
    if key not in prepared:
        prepared[key] = prepare(*(weight_of(new, a) for a in stored), **node.kwargs)
    out = prepared[key]
    if out is None:
        return False
    i = sum(rep.cpu_traced.values())
    with new.graph.inserting_before(node):
        attrs = []
        for j, t in enumerate(out):
            set_weight(new, f"_cpu{i}.w{j}", t)
            attrs.append(new.graph.get_attr(f"_cpu{i}.w{j}"))
    bias = node.args[1 + n] if len(node.args) > 1 + n else None
    node.args = (node.args[0], *attrs, bias)
    retarget(node, fn)
    for a in stored:  # the stored form stays on the model; this graph no longer reads it
        if not a.users:
            new.graph.erase_node(a)
    return True


def rope_tables(head_dim: int, theta: float, scaling: dict | None, max_len: int, device):
    inv = rope_inv_freq(head_dim, theta, scaling).to(device)
    # The same fp32 products as ops.rope (positions.float() * inv_freq), so the same values.
    freqs = torch.arange(max_len, device=device)[:, None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear as a reduction with fp32 accumulation; meant for Inductor at a few rows (GEMV)."""
    y = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def linear_rows_rms(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    eps: float) -> torch.Tensor:
    """linear(rms_norm(x), weight, bias) as (W x) * rsqrt(mean(x^2) + eps) (+ bias), fp32.

    The sum of squares is written as a reduction over the same (rows, out, in) ranges as the
    GEMV (x^2 broadcast along the outputs), so Inductor computes both in one kernel: the norm's
    statistics cost no launch of their own (at batch 1 on small models, launches are the cost).
    Same value as the norm then the linear, without rounding the normalized x to x's dtype."""
    xf = x.unsqueeze(-2).float()
    wf = weight.float()
    y = (xf * wf).sum(-1)
    ss = (xf * xf).expand(*xf.shape[:-2], wf.shape[0], xf.shape[-1]).sum(-1)
    y = y * torch.rsqrt(ss / x.shape[-1] + eps)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# Up to this many weights a matrix is small enough for the rows GEMVs (H200): models whose linears
# all fit are launch-bound, and Inductor's fused GEMVs save launches (above it cuBLAS reads the
# weights faster: llama-1b bs1 827 tok/s against 727, an LM head ~2x); and a GEMV computes its
# input's RMSNorm statistics itself, the extra multiply-add per weight costing less than a launch
# (llama-1b's 2048 x 16384 gate/up GEMV went 18.5 -> 25.5 us with it, SmolLM2's step 10% faster).
ROWS_MAX_WEIGHTS = 1 << 22


def _weights(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    """Weights of a linear node's stored weight (0 when it is not a stored tensor)."""
    w = node.args[1]
    return weight_of(gm, w).numel() if isinstance(w, torch.fx.Node) and w.op == "get_attr" else 0


def largest_linear(gm: torch.fx.GraphModule) -> int:
    """Weights of the largest stored-weight linear (LM head excluded) of an IR graph."""
    return max((_weights(gm, n) for n in gm.graph.nodes
                if n.op == "call_function" and n.target is ops.linear), default=0)


def _norm_into_rows(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Retarget linear_rows `node` to linear_rows_rms where its input is a weightless RMSNorm
    (rms_norm, or add_rms_norm's first output) that feeds nothing else and its weight is small
    enough; whether it was."""
    graph = gm.graph
    if not 0 < _weights(gm, node) <= ROWS_MAX_WEIGHTS:
        return False
    src, fused = node.args[0], None
    if not isinstance(src, torch.fx.Node) or len(src.users) != 1:
        return False
    if src.target is ops.rms_norm and src.args[1] is None:
        x, eps = src.args[0], src.kwargs["eps"]
    elif src.target is operator.getitem and src.args[1] == 0 and isinstance(src.args[0], torch.fx.Node) \
            and src.args[0].target is ops.add_rms_norm and src.args[0].args[2] is None:
        fused = src.args[0]
        sums = [u for u in fused.users if u is not src]
        if not all(u.target is operator.getitem and u.args[1] == 1 for u in sums):
            return False  # the normalized output has another reader
        with graph.inserting_before(fused):
            x = graph.call_function(operator.add, fused.args[:2])  # x + residual, as add_rms_norm
        for u in sums:  # the new residual
            u.replace_all_uses_with(x)
            graph.erase_node(u)
        eps = fused.kwargs["eps"]
    else:
        return False
    node.args = (x, *node.args[1:])
    node.kwargs = {**node.kwargs, "eps": eps}
    retarget(node, linear_rows_rms)
    graph.erase_node(src)
    if fused is not None:
        graph.erase_node(fused)
    return True


# The rewrites between the IR and what runs, in order (`llmc passes --all` lists them). The first
# four are what `llmc compile --verify` checks against the graph on the CPU (gemv through its
# custom ops' reference implementations); fuse-rope and runtime-graph need the paged cache of the
# engine and are tested against the reference executor in tests/runtime.
LOWERING = {
    "custom-ops": "IR ops on the kernels' custom ops, torch.ops.llmaccel.<name> (traced aten forms "
                  "on the CPU); lower(select=...); the norms and SiLU-mul only in the engine's "
                  "eager steps",
    "rope-tables": "rope on cos/sin tables of max_position rows, gathered by position; lower(); in "
                   "the engine's eager steps on a GPU one kernel a rotation (llmaccel::rope_table)",
    "gemv": "one row on CUDA: linears as fused Triton GEMVs with the norm prologue and the "
            "SiLU-mul / residual epilogues; lower(linear='gemv'), the runtime's decode steps",
    "rows": "linear_rows: small linears as row products a compiled step fuses; lower(linear='rows')",
    "fuse-rope": "RoPE, the KV write and the decode attention of a layer in one paged kernel; "
                 "codegen/rope.py, the runtime's decode steps",
    "runtime-graph": "the LM head only on the rows that are sampled; runtime/graph.py, every step",
}


@dataclass
class LowerReport:
    custom: dict[str, int] = field(default_factory=dict)   # op -> nodes now on torch.ops.<ns>
    rejected: dict[str, str] = field(default_factory=dict)  # op -> why its custom op was not used
    rope: int = 0
    linear_rows: int = 0
    norm_into_rows: int = 0  # linear_rows that compute their input's RMSNorm (linear_rows_rms)
    gemv: dict[str, int] = field(default_factory=dict)  # linear="gemv": gemv_rewrites' counts
    kernel_modules: dict[str, str] = field(default_factory=dict)
    cpu_traced: dict[str, int] = field(default_factory=dict)  # op -> nodes on a traced CPU form


def _wanted(name: str, select) -> bool:
    if select == "eager":
        return True
    if select == "all":
        return not OPS[name].eager_only
    if select in (None, "none"):
        return False
    return name in select


def lower(gm: torch.fx.GraphModule, *, max_len: int, select="all", linear: str = "mm",
          last_only: bool = False, namespace: str = "llmaccel",
          prepared: dict | None = None) -> tuple[torch.fx.GraphModule, LowerReport]:
    """A lowered copy of `gm` (weights shared, graph copied); `gm` itself is left unchanged.

    select: "all", "none" or a collection of IR op names to map to custom ops; "eager": all and
        the op table's eager_only ops too (a graph run uncompiled, as the engine's prefill steps).
    linear: "mm" keeps F.linear for the remaining linears; "rows" uses `linear_rows`; "gemv" the
        fused Triton GEMVs (`gemv_rewrites`).
    max_len: positions the rope tables cover.
    last_only: the LM head sees only the last position (a prefill that only needs the next token).
    prepared: weights converted for CPU forms, shared by the lowerings of one model (filled here).
    """
    if linear not in ("mm", "rows", "gemv"):
        raise ValueError(f"linear must be 'mm', 'rows' or 'gemv', got {linear!r}")
    rep = LowerReport()
    prepared = {} if prepared is None else prepared
    if select not in (None, "none"):
        rep.kernel_modules = dict(load_kernel_modules())  # registers the custom ops
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__ + "_lowered")
    device = next((p.device for p in gm.parameters()), torch.device("cpu"))
    if last_only:
        _head_reads_last(new)
    tables: dict[tuple, tuple[str, str]] = {}
    # a weight-quantized graph runs its CPU linears' x in bf16 (int_codes.cpu_act_dtype): its LM
    # head too, a third of a W4 decode step in fp32 (not in the fused GEMVs' lowering: that is
    # CUDA's decode path, which the CPU only checks against the references)
    quantized = any(ir_op_name(n) in ("linear_int4", "linear_int8", "linear_w8a8") for n in new.graph.nodes)
    for node in list(new.graph.nodes):
        name = ir_op_name(node)
        if name is None:
            continue
        if node.target is ops.rope:
            _lower_rope(new, node, tables, max_len, device, select, namespace, rep)
        elif not OPS[name].context and _wanted(name, select):
            # ops with a lowering of their own (attention takes a Python context, rope the
            # tables) never map to a custom op by name; the others do wherever one is registered
            _lower_op(new, node, name, device, namespace, linear, quantized, prepared, rep)
    if linear == "rows":
        _rows_linears(new, rep)
    elif linear == "gemv":
        rep.gemv = gemv_rewrites(new)
    new.graph.lint()
    new.recompile()
    return new, rep


def _head_reads_last(gm: torch.fx.GraphModule) -> None:
    """The LM head reads only the last position of its input."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is ops.lm_head:
            with gm.graph.inserting_before(node):
                last = gm.graph.call_function(operator.getitem,
                                              (node.args[0], (slice(None), slice(-1, None))))
            node.args = (last, *node.args[1:])


def _lower_rope(gm, node, tables: dict, max_len: int, device, select, namespace: str,
                rep: LowerReport) -> None:
    """rope -> rope_table over cos/sin tables (one pair per head_dim / theta / scaling)."""
    key = (node.kwargs["head_dim"], node.kwargs["theta"], repr(node.kwargs.get("scaling")))
    if key not in tables:
        cos, sin = rope_tables(node.kwargs["head_dim"], node.kwargs["theta"],
                               node.kwargs.get("scaling"), max_len, device)
        base = f"_rope{len(tables)}"
        set_weight(gm, base + ".cos", cos)
        set_weight(gm, base + ".sin", sin)
        tables[key] = (base + ".cos", base + ".sin")
    with gm.graph.inserting_before(node):
        c = gm.graph.get_attr(tables[key][0])
        s = gm.graph.get_attr(tables[key][1])
    x, positions = node.args[:2]
    retarget(node, rope_table)
    node.args = (x, c, s, positions)
    node.kwargs = {"head_dim": node.kwargs["head_dim"]}
    rep.rope += 1
    # uncompiled steps on a GPU: one kernel per rotation (kernels/pointwise.py) for the
    # reference's eight aten kernels; compiled steps keep the reference, which Inductor
    # fuses and the decode steps' fuse_rope folds into the attention
    op = custom_op(namespace, "rope_table") if select == "eager" and device.type != "cpu" \
        and node.kwargs["head_dim"] % 2 == 0 else None  # the kernel rotates even halves
    if op is not None:
        retarget(node, op)
        rep.custom["rope_table"] = rep.custom.get("rope_table", 0) + 1


def _lower_op(gm, node, name: str, device, namespace: str, linear: str, quantized: bool,
              prepared: dict, rep: LowerReport) -> None:
    """One IR op -> its CPU form (aten ops traced into the step) or its custom op."""
    # linear="gemv" asks for the fused GEMVs, which take linear_int4's stored weights as
    # they are (their CPU implementation is the reference)
    # (the CPU forms stand for the project's own custom ops: another namespace gets its ops)
    form = cpu_forms().get(name) if device.type == "cpu" and namespace == "llmaccel" and not (
        linear == "gemv" and int4_gemv_weights(node)) else None
    if name == "lm_head" and device.type == "cpu" and quantized and linear != "gemv":
        form = (prepare_head_cpu, int8_mm_cpu, 1)
    elif name in ("linear", "lm_head") and device.type == "cpu" and namespace == "llmaccel" \
            and linear != "gemv":
        form = (prepare_bf16_cpu, linear_bf16_cpu, 1)
    if form is not None and _to_cpu_form(gm, node, form, rep, prepared):
        rep.cpu_traced[name] = rep.cpu_traced.get(name, 0) + 1
        return
    op = custom_op(namespace, name)
    if op is None:
        return
    if not accepts(op, node):
        rep.rejected[name] = f"schema {op.default._schema} does not take the IR node's arguments"
        return
    retarget(node, op)
    rep.custom[name] = rep.custom.get(name, 0) + 1


def _rows_linears(gm, rep: LowerReport) -> None:
    """linear="rows": linears (and LM heads up to ROWS_MAX_WEIGHTS) -> linear_rows, with the
    norm before folded in where it can be."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (ops.linear, ops.lm_head):
            is_linear = node.target is ops.linear
            if not is_linear and _weights(gm, node) > ROWS_MAX_WEIGHTS:
                continue  # a large LM head reads faster through cuBLAS (H200: ~2x)
            retarget(node, linear_rows)
            rep.linear_rows += 1
            if is_linear and _norm_into_rows(gm, node):
                rep.norm_into_rows += 1


__all__ = ["lower", "LowerReport", "rope_table", "linear_rows", "linear_rows_rms", "largest_linear",
           "gemv_rewrites",
           "ROWS_MAX_WEIGHTS", "LOWERING",
           "load_kernel_modules", "accepts"]
