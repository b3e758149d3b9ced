"""Artifact directory: manifest.json, model.safetensors, tokenizer files, report.md/json.

Written whole or not at all (see atomic.py); the manifest records every file's size and
SHA-256, checked on load."""
from __future__ import annotations

import json
import os
import platform
import shutil
import time
from importlib import metadata
from pathlib import Path

import torch

from llmaccel.compiler.atomic import atomic_dir
from llmaccel.compiler.manifest import check_files, check_manifest, file_records
from llmaccel.compiler.serialize import graph_to_json
from llmaccel.errors import LlmaccelError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                    "added_tokens.json", "generation_config.json")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("llmaccel", "torch", "transformers", "safetensors", "gguf"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def is_artifact(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def check_output(path, force: bool = False, force_flag: str = "force=True", *, kind: str = "artifact",
                 is_kind=is_artifact) -> None:
    """Refuse an output path before any work: a file, a non-empty folder that is not of this
    kind (`is_kind(path)`: an artifact, or an export), or one of this kind unless `force`; an
    unwritable place."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise LlmaccelError(f"{path} is an existing file; an {kind} is a folder: choose another path")
    if path.is_dir() and any(path.iterdir()):
        if not is_kind(path):
            raise LlmaccelError(f"{path} is a folder with other files in it, not an llmaccel "
                                f"{kind}: choose an empty or new folder")
        if not force:
            raise LlmaccelError(f"{path} holds an {kind} already; {force_flag} replaces it")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise LlmaccelError(f"cannot write {path}: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LlmaccelError(f"cannot write {path}: {parent} is not writable")


def _write_files(model, path: Path, report: dict | None) -> None:
    from safetensors.torch import save_file

    from llmaccel.ir import graph_weights

    # Clone so that views of one storage (splits, tied weights) are saved as separate tensors.
    weights = {k: v.detach().to("cpu").contiguous().clone() for k, v in graph_weights(model.gm).items()}
    save_file(weights, str(path / "model.safetensors"))
    if model.tokenizer_dir:
        for name in _TOKENIZER_FILES:
            f = Path(model.tokenizer_dir) / name
            if f.exists():
                shutil.copy(f, path / name)
    if report is not None:
        from llmaccel.compiler.report import render_markdown
        from llmaccel.eval.heal_plot import write_heal_plot

        (path / "report.json").write_text(json.dumps(report, indent=2))
        (path / "report.md").write_text(render_markdown(report))
        write_heal_plot(report, path / "heal.png")  # a heal's loss and domain curves, if any
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": model.source,
        "config": model.config.to_dict(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "recipe": model.recipe,
        "versions": versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": file_records(path),
        "graph": graph_to_json(model.gm.graph),
    }
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))


def write_artifact(model, path, report: dict | None = None, *, force: bool = False) -> Path:
    """Write the artifact folder atomically: a previous artifact at `path` is replaced only
    with force=True, and only once the new one is complete."""
    path = Path(path)
    check_output(path, force)
    with atomic_dir(path) as tmp:
        _write_files(model, tmp, report)
    return path


def read_manifest(path: Path) -> dict:
    try:
        text = (path / MANIFEST).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LlmaccelError(f"cannot read {path}/{MANIFEST}: {e}") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise LlmaccelError(f"{path}/{MANIFEST} is not valid JSON: {e}") from None


def read_artifact(path, *, dtype=torch.float32, device="cpu"):
    """(config, weights, tokenizer folder or None, manifest) of a checked artifact folder;
    compiler/sources.py makes them a Source."""
    from llmaccel.compiler.filecheck import load_safetensors

    path = Path(path)
    manifest = read_manifest(path)
    cfg = check_manifest(manifest, path, FORMAT_VERSION)
    check_files(path, manifest.get("files", {}))
    weights = load_safetensors(path / "model.safetensors", device=device)
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    tok = str(path) if (path / "tokenizer_config.json").exists() else None
    return cfg, weights, tok, manifest
