"""An artifact's manifest.json: its fields type-checked, and the files it lists (size and
SHA-256) checked on load, so a damaged or hand-edited artifact fails in one line that names
the field or the file instead of deep inside the loader."""
from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

from llmaccel.config import ModelConfig
from llmaccel.errors import LlmaccelError

_INT = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
_NUM = lambda v: (_INT(v) or isinstance(v, float)) and math.isfinite(v)  # noqa: E731
# ModelConfig's annotations (strings under `from __future__ import annotations`) -> check
_CONFIG_TYPES = {
    "str": lambda v: isinstance(v, str),
    "int": _INT,
    "float": _NUM,
    "bool": lambda v: isinstance(v, bool),
    "dict[str, Any] | None": lambda v: v is None or isinstance(v, dict),
    "int | None": lambda v: v is None or _INT(v),
    "int | list[int] | None": lambda v: v is None or _INT(v) or (
        isinstance(v, list) and all(_INT(x) for x in v)),
}
_NODE_OPS = ("placeholder", "get_attr", "call_function", "call_method", "output")


def _bad(path, what: str) -> LlmaccelError:
    return LlmaccelError(f"{path}/manifest.json: {what}; the artifact is damaged, recompile it")


def check_config(d, path) -> ModelConfig:
    if not isinstance(d, dict):
        raise _bad(path, "config is not an object")
    for f in dataclasses.fields(ModelConfig):
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _bad(path, f"config has no {f.name}")
            continue
        ok = _CONFIG_TYPES.get(str(f.type), lambda v: True)
        if not ok(d[f.name]):
            raise _bad(path, f"config.{f.name} is {d[f.name]!r}, not a {f.type}")
    return ModelConfig.from_dict(d)


def _check_node(i: int, n, path) -> None:
    if not (isinstance(n, dict) and isinstance(n.get("name"), str) and n.get("op") in _NODE_OPS
            and isinstance(n.get("target"), str) and isinstance(n.get("args"), list)
            and isinstance(n.get("kwargs"), dict)):
        raise _bad(path, f"graph node {i} is malformed (name, op in {', '.join(_NODE_OPS)}, "
                         f"target, args, kwargs)")


def check_manifest(m, path, format_version: int) -> ModelConfig:
    """Type-check the fields read on load; returns the model config."""
    if not isinstance(m, dict):
        raise _bad(path, "not a JSON object")
    fv = m.get("format_version")
    if not _INT(fv) or fv < 1:
        raise _bad(path, f"format_version is {fv!r}, not a positive integer")
    if fv > format_version:
        raise LlmaccelError(f"{path} has artifact format {fv}; this llmaccel reads up to "
                            f"{format_version}: upgrade llmaccel")
    cfg = check_config(m.get("config"), path)
    graph = m.get("graph")
    if not isinstance(graph, list) or not graph:
        raise _bad(path, "graph is not a non-empty list")
    for i, n in enumerate(graph):
        _check_node(i, n, path)
    if not isinstance(m.get("recipe", []), list):
        raise _bad(path, "recipe is not a list")
    files = m.get("files", {})
    if not isinstance(files, dict) or not all(
            _plain_name(k) and isinstance(v, dict) and _INT(v.get("size")) and
            isinstance(v.get("sha256"), str) for k, v in files.items()):
        raise _bad(path, "files is not an object of {name: {size, sha256}}")
    return cfg


def _plain_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name \
        and "\\" not in name


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_records(folder: Path) -> dict:
    """{name: {size, sha256}} of every file in the folder (manifest.json excluded)."""
    return {p.name: {"size": p.stat().st_size, "sha256": sha256(p)}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != "manifest.json"}


def check_files(folder: Path, files: dict) -> None:
    """Every file the manifest lists is present, of its size and checksum."""
    for name, rec in files.items():
        p = folder / name
        if not p.is_file():
            raise LlmaccelError(f"{folder} is missing {name} (listed in its manifest); the "
                                f"artifact is damaged, recompile it")
        size = p.stat().st_size
        if size != rec["size"]:
            raise LlmaccelError(f"{p} is damaged: {size} bytes where the manifest records "
                                f"{rec['size']}; recompile the artifact")
        if sha256(p) != rec["sha256"]:
            raise LlmaccelError(f"{p} is damaged: its SHA-256 differs from the manifest's; "
                                f"recompile the artifact")
