"""What marks a folder as an export: read by `llmc eval` / `llmc generate` for every source they
are given, so it imports nothing from the onnx extra (exporter.py and runtime.py do)."""
from __future__ import annotations

from pathlib import Path

MANIFEST = "llmaccel_export.json"
MODEL_FILE = "model.onnx"


def is_export_dir(src: str) -> bool:
    p = Path(src)
    return p.is_dir() and (p / MANIFEST).exists() and (p / MODEL_FILE).exists()
