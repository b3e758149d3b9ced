"""Artifact directory: manifest.json, model.safetensors, tokenizer files, report.md/json."""
from __future__ import annotations

import json
import platform
import shutil
import time
from importlib import metadata
from pathlib import Path

import torch

from llmaccel.compiler.serialize import graph_to_json
from llmaccel.config import ModelConfig
from llmaccel.errors import LlmaccelError

FORMAT_VERSION = 1
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


def write_artifact(model, path, report: dict | None = None) -> Path:
    from safetensors.torch import save_file

    from llmaccel.compiler.model import graph_weights

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # Clone so that views of one storage (splits, tied weights) are saved as separate tensors.
    weights = {k: v.detach().to("cpu").contiguous().clone() for k, v in graph_weights(model.gm).items()}
    save_file(weights, str(path / "model.safetensors"))
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": model.source,
        "config": model.config.to_dict(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "recipe": model.recipe,
        "versions": versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "graph": graph_to_json(model.gm.graph),
    }
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if model.tokenizer_dir:
        for name in _TOKENIZER_FILES:
            f = Path(model.tokenizer_dir) / name
            if f.exists() and f.resolve() != (path / name).resolve():
                shutil.copy(f, path / name)
    if report is not None:
        from llmaccel.compiler.report import render_markdown

        (path / "report.json").write_text(json.dumps(report, indent=2))
        (path / "report.md").write_text(render_markdown(report))
    return path


def read_artifact(path, *, dtype=torch.float32, device="cpu"):
    from safetensors.torch import load_file

    from llmaccel.compiler.sources import Source

    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except json.JSONDecodeError as e:
        raise LlmaccelError(f"{path}/manifest.json is not valid JSON: {e}") from e
    fv = manifest.get("format_version")
    if not isinstance(fv, int) or fv > FORMAT_VERSION:
        raise LlmaccelError(f"{path} has artifact format {fv}; this llmaccel reads up to "
                            f"{FORMAT_VERSION}: upgrade llmaccel")
    weights = load_file(str(path / "model.safetensors"), device=str(device))
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    tok = str(path) if (path / "tokenizer_config.json").exists() else None
    return Source(str(path), "artifact", ModelConfig.from_dict(manifest["config"]), weights,
                  tok, manifest)
