"""Tensor parallelism: the IR graph of rank r of N, Megatron-style.

    shard(gm, config, rank=r, world=N, group=NAME) -> (graph module of rank r, its config)

Each decoder layer is cut by heads and by the MLP's inner width:
  * q, k, v (separate linears or `fuse`'s one qkv linear and its split): column-parallel, rank r
    keeps query heads r H/N .. (r+1) H/N - 1 and KV heads r Hkv/N .. likewise, whole GQA groups,
    so a KV head never splits (N must divide Hkv);
  * the attention node attends over its H/N heads (its KV cache holds Hkv/N heads);
  * o: row-parallel (the columns of its heads), followed by all_reduce (ops/collective.py);
  * gate, up (or `fuse`'s gate_up and its split): column-parallel; down: row-parallel +
    all_reduce. A bias of a row-parallel linear is added on rank 0 only.
The embedding, the norms and the LM head stay whole on every rank (the head replicated: each
rank samples the same token from the same logits, and no gather is needed).
Stored weights of linear_int8 are cut the same way (rows with their scales, columns as they
are); linear_int4 cuts rows freely and columns on group boundaries, so a row-parallel int4
linear needs K / N to be a multiple of the group size.

Sharding happens where the model is loaded for a rank, not in `llmc compile`: one artifact runs
at any N. Graphs with ops whose sharding is not written here (KIVI, sla, bitlinear, sparse,
GPT-2's fused c_attn) are refused with one line.
"""
from __future__ import annotations

import copy
import dataclasses
import operator

import torch
import torch.fx

from llmaccel import ops
from llmaccel.config import ModelConfig
from llmaccel.errors import LlmaccelError
from llmaccel.ir import set_weight, weight_of
from llmaccel.ops import collective
from llmaccel.ops import quant as q
from llmaccel.ops.table import spec_of

_LINEARS = (ops.linear, q.linear_int8, q.linear_int4)
_GLU = (ops.silu_mul, ops.gelu_mul)
# ops a sharded graph may hold, besides the linears: whole on every rank, or cut above
_WHOLE = {"embedding", "rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm", "rope", "attention",
          "silu_mul", "gelu_mul", "lm_head"}


def sizes(config: ModelConfig) -> list[int]:
    """Every N that shards this model: N divides the KV heads, the query heads and the MLP."""
    return [n for n in range(1, config.n_kv_heads + 1)
            if config.n_kv_heads % n == 0 and config.n_heads % n == 0 and config.intermediate_size % n == 0]


def check(config: ModelConfig, world: int) -> None:
    """One line when `world` ranks cannot shard this model."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise LlmaccelError(f"tensor_parallel_size must be a positive integer, got {world!r}")
    if world not in sizes(config):
        raise LlmaccelError(
            f"tensor_parallel_size {world} does not divide this model ({config.n_heads} query heads, "
            f"{config.n_kv_heads} KV heads, MLP width {config.intermediate_size}; a KV head never "
            f"splits): it takes {', '.join(map(str, sizes(config)))}")


def shard(gm: torch.fx.GraphModule, config: ModelConfig, *, rank: int, world: int,
          group: str) -> tuple[torch.fx.GraphModule, ModelConfig]:
    """Rank `rank`'s graph (a copy; gm is left as it is) and config (heads and MLP width per rank)."""
    check(config, world)
    if config.family != "llama":
        raise LlmaccelError(f"tensor parallelism shards llama-family graphs; this one is {config.family}")
    if not 0 <= rank < world:
        raise LlmaccelError(f"rank {rank} is not one of the {world} ranks")
    if world == 1:
        return gm, config
    bad = sorted({s.name for n in gm.graph.nodes if n.op == "call_function"
                  for s in [spec_of(n.target)] if s is not None and s.name not in _WHOLE
                  and s.ref not in _LINEARS})
    if bad:
        raise LlmaccelError(f"tensor parallelism cannot shard a graph with {', '.join(bad)} "
                            f"(it cuts plain, int8 and int4 linears, attention and GLU MLPs)")
    new = copy.deepcopy(gm)
    cut = _Cut(new, rank, world, group)
    for node in list(new.graph.nodes):
        if node.op == "call_function" and node.target is ops.attention:
            cut.attention(node, config)
        elif node.op == "call_function" and node.target in _GLU:
            cut.mlp(node)
    new.graph.lint()
    new.recompile()
    per = dataclasses.replace(config, n_heads=config.n_heads // world,
                              n_kv_heads=config.n_kv_heads // world,
                              intermediate_size=config.intermediate_size // world)
    return new, per


class _Cut:
    """The rewrites of one rank's graph."""

    def __init__(self, gm: torch.fx.GraphModule, rank: int, world: int, group: str):
        self.gm, self.rank, self.world, self.group = gm, rank, world, group

    def attention(self, node: torch.fx.Node, config: ModelConfig) -> None:
        kw = node.kwargs
        H, Hkv, D = kw["n_heads"], kw["n_kv_heads"], kw["head_dim"]
        widths = (H * D, Hkv * D, Hkv * D)
        self._columns(node.args[:3], widths)
        node.kwargs = {**kw, "n_heads": H // self.world, "n_kv_heads": Hkv // self.world}
        self._rows_then_reduce(node, H * D)

    def mlp(self, node: torch.fx.Node) -> None:
        gate, up = node.args[:2]
        lin = self._source(gate)[0]
        n_out = self._out_features(lin)
        inner = n_out // 2 if lin is self._source(up)[0] else n_out  # fused gate_up: two halves
        self._columns((gate, up), (inner, inner))
        self._rows_then_reduce(node, inner)

    # --- finding the producers ------------------------------------------------------------------

    def _source(self, v: torch.fx.Node) -> tuple[torch.fx.Node, int | None]:
        """(the linear that computes v, index of v in its split or None), through rope."""
        while v.op == "call_function" and v.target is ops.rope:
            v = v.args[0]
        idx = None
        if v.op == "call_function" and v.target is operator.getitem:
            split, idx = v.args
            if not (split.op == "call_method" and split.target == "split"):
                raise LlmaccelError(f"tensor parallelism: {v.name} reads {split.name}, not a split")
            v = split.args[0]
        if not (v.op == "call_function" and v.target in _LINEARS):
            raise LlmaccelError(f"tensor parallelism: {v.name} is not a linear it can cut")
        return v, idx

    def _out_features(self, lin: torch.fx.Node) -> int:
        return weight_of(self.gm, lin.args[1]).shape[0]

    # --- column-parallel producers ----------------------------------------------------------------

    def _columns(self, values, widths) -> None:
        """Cut the producers of `values` (each of full width widths[i]) to rank's share."""
        seen: dict[torch.fx.Node, list] = {}
        for v, w in zip(values, widths):
            lin, idx = self._source(v)
            seen.setdefault(lin, []).append((idx, w))
        for lin, parts in seen.items():
            if parts[0][0] is None:  # a linear of its own: its rows are one part
                self._cut_rows(lin, [(0, parts[0][1])])
                continue
            split = next(u for u in lin.users if u.op == "call_method" and u.target == "split")
            full = list(split.args[1])
            starts = [sum(full[:i]) for i in range(len(full))]
            rows = []
            for i, w in enumerate(full):
                if i not in {idx for idx, _ in parts}:
                    raise LlmaccelError(f"tensor parallelism: part {i} of {split.name} feeds no "
                                        f"attention or MLP it cuts")
                rows.append((starts[i], w))
            self._cut_rows(lin, rows)
            split.args = (split.args[0], [w // self.world for w in full], *split.args[2:])

    def _cut_rows(self, lin: torch.fx.Node, parts) -> None:
        """Keep, of each (start, width) block of output rows, rank's 1/N."""
        idx = torch.cat([torch.arange(s + self.rank * w // self.world, s + (self.rank + 1) * w // self.world)
                         for s, w in parts])
        bias_at = 4 if lin.target is q.linear_int4 else 3 if lin.target is q.linear_int8 else 2
        n_stored = bias_at - 1
        for a in list(lin.args[1:1 + n_stored]) + [lin.args[bias_at] if len(lin.args) > bias_at else None]:
            if a is not None:
                self._set(a, weight_of(self.gm, a)[idx])

    # --- row-parallel consumers -------------------------------------------------------------------

    def _rows_then_reduce(self, value: torch.fx.Node, width: int) -> None:
        """The linear reading `value` (its rank's 1/N of `width` columns) keeps those columns of
        its weight; its output is summed over the ranks."""
        users = [u for u in value.users if u.op == "call_function" and u.target in _LINEARS]
        if len(users) != 1 or len(value.users) != 1:
            raise LlmaccelError(f"tensor parallelism: {value.name} must feed exactly one linear")
        lin = users[0]
        c0, c1 = self.rank * width // self.world, (self.rank + 1) * width // self.world
        w = weight_of(self.gm, lin.args[1])
        if lin.target is q.linear_int4:
            gs = lin.kwargs["group_size"]
            if c0 % gs or (c1 - c0) % gs:
                raise LlmaccelError(f"tensor parallelism: int4 groups of {gs} do not split "
                                    f"{lin.name}'s {width} columns over {self.world} ranks")
            g0, g1 = c0 // gs, c1 // gs
            self._set(lin.args[1], w[:, g0:g1].contiguous())
            self._set(lin.args[2], weight_of(self.gm, lin.args[2])[:, g0:g1].contiguous())
            zeros = q.unpack_int4(weight_of(self.gm, lin.args[3]))[:, g0:g1]
            self._set(lin.args[3], q.pack_zeros(zeros))
        else:
            self._set(lin.args[1], w[:, c0:c1].contiguous())
        bias_at = 4 if lin.target is q.linear_int4 else 3 if lin.target is q.linear_int8 else 2
        if self.rank and len(lin.args) > bias_at and lin.args[bias_at] is not None:
            lin.args = (*lin.args[:bias_at], None, *lin.args[bias_at + 1:])  # added once, on rank 0
        with self.gm.graph.inserting_after(lin):
            red = self.gm.graph.call_function(collective.all_reduce, (lin,), {"group": self.group})
        lin.replace_all_uses_with(red, delete_user_cb=lambda u: u is not red)

    def _set(self, attr: torch.fx.Node, value: torch.Tensor) -> None:
        set_weight(self.gm, attr.target, value.contiguous())
