"""Export an IR graph to an ONNX folder: walk the fx graph and translate each node.

    model.onnx, model.onnx.data    the graph (Optimum names) and its weights as external data
    llmaccel_export.json           config, format, dtype and how the folder was made
    tokenizer files                copied from the source
    genai_config.json              --format genai only (ONNX Runtime GenAI's loader reads it)

Written whole or not at all (compiler/atomic.py), as artifacts are; llmaccel_export.json with
model.onnx marks a folder as an export, which only force=True replaces.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import onnx
import torch
from onnx import TensorProto

from llmaccel.compiler.artifact import check_output
from llmaccel.compiler.atomic import atomic_dir
from llmaccel.compiler.model import Model
from llmaccel.errors import LlmaccelError
from llmaccel.ir import attention_layers, get_attr
from llmaccel.export import refusals
from llmaccel.export.builder import DATA_FILE, NP_DTYPES, ExternalData, GraphBuilder
from llmaccel.export.folder import MANIFEST, MODEL_FILE, is_export_dir
from llmaccel.export.std_ops import TRANSLATIONS, Env, Weight

FORMATS = ("genai", "onnx")
OPSET = 21
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json",
                    "generation_config.json")


def op_name(node: torch.fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def translations(fmt: str) -> dict:
    if fmt == "genai":
        from llmaccel.export.genai_ops import GENAI_TRANSLATIONS

        return {**TRANSLATIONS, **GENAI_TRANSLATIONS}
    return TRANSLATIONS


def check_translatable(gm: torch.fx.GraphModule, table: dict) -> None:
    """One line naming the first op that has no ONNX form, before any file is written."""
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        if n.kwargs.get("kv_dtype") is not None:
            raise LlmaccelError(refusals.KV_DTYPE)
        if n.target in table:
            continue
        raise LlmaccelError(refusals.message(n.target, op_name(n)))


def shared_weights(gm: torch.fx.GraphModule) -> set[str]:
    """Weights read by more than one op (a tied embedding and LM head)."""
    users: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            users[n.target] = users.get(n.target, 0) + len(n.users)
    return {k for k, v in users.items() if v > 1}


def _inputs(b: GraphBuilder, layers: dict[int, tuple[int, int]], with_positions: bool):
    i64 = TensorProto.INT64
    ids = b.add_input("input_ids", i64, ["batch_size", "sequence_length"])
    mask = b.add_input("attention_mask", i64, ["batch_size", "total_sequence_length"])
    pos = b.add_input("position_ids", i64, ["batch_size", "sequence_length"]) if with_positions else None
    past = {}
    for i, (kvh, hd) in layers.items():
        shape = ["batch_size", kvh, "past_sequence_length", hd]
        past[i] = tuple(b.add_input(f"past_key_values.{i}.{kv}", b.onnx_dtype, shape) for kv in ("key", "value"))
    return ids, mask, pos, past


def build(model: Model, fmt: str, dtype: torch.dtype, out: Path) -> tuple[onnx.ModelProto, dict]:
    gm = model.gm
    table = translations(fmt)
    check_translatable(gm, table)
    layers = dict(sorted(attention_layers(gm).items()))  # layer -> (n_kv_heads, head_dim)
    data = ExternalData(out)
    b = GraphBuilder(data, dtype)
    absorbed, k_of = set(), {}
    if fmt == "genai":
        from llmaccel.export.genai_ops import absorbed_ropes, in_features

        absorbed, k_of = absorbed_ropes(gm), in_features(gm)
    positions = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "positions")
    try:
        ids, mask, pos, past = _inputs(b, layers, with_positions=bool(set(positions.users) - absorbed))
        env = Env(b, ids, pos, mask, model.config, fmt, model.config.max_position, past=past,
                  shared_weights=shared_weights(gm), absorbed=absorbed, in_features=k_of)
        values: dict[torch.fx.Node, object] = {}
        placeholders = iter((ids, pos, None))
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                values[n] = next(placeholders)
            elif n.op == "get_attr":
                values[n] = Weight(n.target, get_attr(gm, n.target))
            elif n.op in ("call_function", "call_method"):
                args = torch.fx.node.map_arg(n.args, lambda a: values[a])
                kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: values[a])
                values[n] = table[n.target](env, n, *args, **kwargs)
            elif n.op == "output":
                res = values[n.args[0]]
                b.op("Identity", [res], outputs=["logits"])
    finally:
        data.close()
    b.add_output("logits", b.onnx_dtype, ["batch_size", "sequence_length", model.config.vocab_size])
    for i, (kvh, hd) in layers.items():
        shape = ["batch_size", kvh, "total_sequence_length", hd]
        for kv in ("key", "value"):
            b.add_output(f"present.{i}.{kv}", b.onnx_dtype, shape)
    facts = {"layers": {str(i): {"n_kv_heads": kvh, "head_dim": hd} for i, (kvh, hd) in layers.items()},
             "inputs": [v.name for v in b.inputs], "weights_bytes": data.nbytes,
             "gqa": fmt == "genai" and bool(layers)}
    return b.model(OPSET, "llmaccel"), facts


def check_export_output(path, force: bool = False, force_flag: str = "force=True") -> None:
    """Refuse, before any work, an output that is a file, a non-empty folder that is not an
    export, or an export unless `force`."""
    check_output(path, force, force_flag, kind="export", is_kind=is_export_dir)


def export(model: Model, out, *, fmt: str = "genai", dtype: str | torch.dtype = "float32",
           force: bool = False) -> Path:
    """Write `model` (any IR graph) as an ONNX folder; returns the folder. Written whole or not
    at all: a previous export at `out` is replaced only with force=True, once the new one is
    complete."""
    from llmaccel.compiler.model import parse_dtype

    if fmt not in FORMATS:
        raise LlmaccelError(f"unknown export format {fmt!r}; known: {', '.join(FORMATS)}")
    dt = parse_dtype(dtype)
    if dt not in NP_DTYPES:
        raise LlmaccelError(f"export dtype {dt} is not supported (ONNX Runtime's CPU kernels have "
                            f"no bfloat16 matmuls); use float32 or float16")
    out = Path(out)
    check_export_output(out, force)
    with atomic_dir(out) as tmp:
        _write_files(model, tmp, fmt, dt)
    return out


def _write_files(model: Model, out: Path, fmt: str, dt: torch.dtype) -> None:
    t0 = time.perf_counter()
    proto, facts = build(model, fmt, dt, out)
    path = out / MODEL_FILE
    onnx.save(proto, str(path))
    onnx.checker.check_model(str(path))
    copy_tokenizer(model, out)
    manifest = {"format": fmt, "dtype": str(dt).removeprefix("torch."), "source": model.source,
                "config": model.config.to_dict(), "recipe": model.recipe, "opset": OPSET,
                "data_file": DATA_FILE, "export_s": round(time.perf_counter() - t0, 2), **facts}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if fmt == "genai":
        from llmaccel.export.genai_config import write_genai_config

        write_genai_config(out, model, manifest)


def copy_tokenizer(model: Model, out: Path) -> None:
    if not model.tokenizer_dir:
        return
    for name in _TOKENIZER_FILES:
        f = Path(model.tokenizer_dir) / name
        if f.exists() and f.resolve() != (out / name).resolve():
            shutil.copy(f, out / name)
