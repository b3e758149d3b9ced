"""Seed files, byte mutations and loader targets shared by the fuzz tests and
scripts/fuzz_loaders.py.

A target takes a mutated file and runs the loader that would read it; it returns 'ok' when the
file loads, 'error' when the loader says what is wrong in one LlmaccelError line, and lets
anything else escape (a traceback: a defect).
"""
from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np

from llmaccel.errors import LlmaccelError

INTERESTING_U64 = (0, 1, 2, 3, 7, 0xFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1,
                   2**63, 2**64 - 1, 1 << 40)


# ----------------------------------------------------------------------------- seeds
def tiny_gguf(path: Path) -> Path:
    """A small llama-shaped GGUF written by the gguf package: metadata of every value kind
    (strings, arrays of strings and numbers, nested counts) and tensors in F32, F16, Q8_0, Q4_0."""
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(64)])
    w.add_token_types([1] * 64)
    w.add_token_merges(["t 1", "t 2"])
    w.add_bos_token_id(1)
    w.add_array("test.floats", [0.5, 1.5, 2.5])
    w.add_bool("test.flag", True)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((64, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((32, 32)).astype(np.float16))
    for name, qt in (("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.Q8_0),
                     ("blk.0.ffn_down.weight", gguf.GGMLQuantizationType.Q4_0)):
        x = rng.standard_normal((64, 64), dtype=np.float32)
        q = quantize(x, qt)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_hf_dir(path: Path) -> Path:
    """An HF checkpoint folder (config.json + model.safetensors) of preset:tiny-llama."""
    from safetensors.torch import save_file

    from llmaccel.compiler.hf import config_to_hf, weights_to_hf
    from llmaccel.compiler.presets import PRESETS, preset_weights

    cfg = PRESETS["tiny-llama"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    sd = {k: v.contiguous().clone() for k, v in weights_to_hf(preset_weights("tiny-llama"), cfg).items()}
    save_file(sd, str(path / "model.safetensors"))
    return path


def tiny_artifact(path: Path) -> Path:
    from llmaccel.compiler.pipeline import compile

    m = compile("preset:tiny-llama", ["fuse"], progress=False)
    m.save(path)
    return path


def real_gguf() -> Path:
    from llmaccel.compiler.sources import builtin_gguf

    return builtin_gguf("smollm2-135m")


# ----------------------------------------------------------------------------- mutations
def header_end(data: bytes, kind: str) -> int:
    """Bytes worth mutating most: the GGUF metadata and tensor infos, the safetensors header."""
    if kind == "safetensors" and len(data) >= 8:
        return min(len(data), 8 + struct.unpack_from("<Q", data)[0])
    if kind == "gguf":
        from llmaccel.compiler.filecheck import check_bytes

        return min(len(data), check_bytes(data, "gguf")["data_offset"])
    return len(data)


OPS = ("flip", "byte", "u64", "u32", "truncate", "delete", "insert", "duplicate")


def apply_edits(data: bytes, edits) -> bytes:
    """Edits are (op, position, payload bytes); positions wrap to the current length."""
    b = bytearray(data)
    for op, pos, payload in edits:
        pos = pos % max(1, len(b))
        n = len(payload) or 1
        if op == "flip" and b:
            b[pos] ^= 1 << (payload[0] % 8 if payload else 0)
        elif op == "byte" and b:
            b[pos] = payload[0] if payload else 0
        elif op in ("u64", "u32"):
            v = INTERESTING_U64[payload[0] % len(INTERESTING_U64)] if payload else 0
            fmt = "<Q" if op == "u64" else "<I"
            b[pos:pos + struct.calcsize(fmt)] = struct.pack(fmt, v & (2 ** (8 * struct.calcsize(fmt)) - 1))
        elif op == "truncate":
            del b[pos:]
        elif op == "delete":
            del b[pos:pos + n * 4]
        elif op == "insert":
            b[pos:pos] = payload
        elif op == "duplicate":
            b[(pos * 7919) % max(1, len(b)):0] = b[pos:pos + n * 4]
    return bytes(b)


def mutate(data: bytes, rng: random.Random, hot: int) -> bytes:
    """One to four random edits, nine in ten inside the first `hot` bytes."""
    edits = []
    for _ in range(rng.randint(1, 4)):
        span = hot if rng.random() < 0.9 else len(data)
        edits.append((rng.choice(OPS), rng.randrange(max(1, span)),
                      bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))))
    return apply_edits(data, edits)


def _json_values(rng: random.Random):
    return rng.choice([None, True, -1, 0, 2**63, 1e308, float("nan"), "", "x" * 3, [], {}, [1, "a"],
                       {"node": "nope"}, {"a": 1, "b": 2}, {"dtype": "load"}, -2**70])


def mutate_manifest(data: bytes, rng: random.Random) -> bytes:
    """Half the time bytes; else one JSON field replaced, deleted or retyped at any depth."""
    if rng.random() < 0.5:
        return mutate(data, rng, len(data))
    doc = json.loads(data)
    for _ in range(rng.randint(1, 3)):
        parent, key = _random_slot(doc, rng)
        if parent is None:
            continue
        if rng.random() < 0.3 and isinstance(parent, dict):
            parent.pop(key, None)
        else:
            parent[key] = _json_values(rng)
    return json.dumps(doc).encode()


def _random_slot(doc, rng: random.Random):
    parent, key, node = None, None, doc
    for _ in range(rng.randint(1, 6)):
        if isinstance(node, dict) and node:
            parent, key = node, rng.choice(list(node))
        elif isinstance(node, list) and node:
            parent, key = node, rng.randrange(len(node))
        else:
            break
        node = parent[key]
    return parent, key


# ----------------------------------------------------------------------------- targets
def load_gguf(path: Path, reader: bool = True) -> str:
    """The checks the loader runs before any GGUF parser; on a file they pass, the gguf reader
    itself must then read every tensor (what transformers does next)."""
    from llmaccel.compiler.sources import check_gguf_model

    try:
        check_gguf_model(path)
    except LlmaccelError as e:
        return _one_line(e)
    if reader:
        import gguf

        r = gguf.GGUFReader(str(path))
        for t in r.tensors:
            np.asarray(t.data).tobytes()  # every byte the header points at is readable
    return "ok"


def _outcome(load, path) -> str:
    try:
        load(path)
    except LlmaccelError as e:
        return _one_line(e)
    return "ok"


def load_hf(folder: Path) -> str:
    from llmaccel.compiler.hf import read_hf_dir

    return _outcome(read_hf_dir, folder)


def load_safetensors_file(path: Path) -> str:
    from llmaccel.compiler.filecheck import load_safetensors

    return _outcome(load_safetensors, path)


def load_artifact(folder: Path) -> str:
    from llmaccel.compiler.model import load

    return _outcome(lambda p: load(str(p)), folder)


def _one_line(e: LlmaccelError) -> str:
    msg = str(e)
    if "\n" in msg or not msg:
        raise AssertionError(f"an error message of more than one line: {msg!r}")
    return "error"


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst
