"""Header checks for model files from the internet, run before any third-party parser sees them.

GGUF and safetensors headers declare counts, lengths and offsets that parsers trust: a GGUF
that declares an array of 2^63 elements makes the gguf reader loop for ever, and out-of-bounds
offsets are the classic parser bug. Here every declared count, length and offset is bounded by
the bytes that remain in the file before it is used, so the work done is linear in the file
size; a deadline bounds it in time as well. Anything off ends in one LlmaccelError line that
names the file and the field.
"""
from __future__ import annotations

import json
import mmap
import struct
import time
from pathlib import Path

from llmaccel.errors import LlmaccelError

GGUF_VERSIONS = (2, 3)  # what gguf's reader handles
GGML_MAX_DIMS = 4
CHECK_SECONDS = 3.0
# Bounds independent of the file size, far above real models (tens of metadata keys, a few
# thousand tensors, 262k-token vocabularies, 280k merges, no arrays of arrays), so that
# the check takes at most about a second whatever the header declares.
MAX_ITEMS = 1 << 20  # keys, values, array elements, tensor infos
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 18
MAX_NESTED = 1 << 16  # elements of an array of arrays
SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit
# GGUF value types: fixed sizes of the scalar ones; 8 = string, 9 = array.
_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_MIN_VALUE = {**{t: struct.calcsize(f) for t, f in _GGUF_SCALAR.items()}, _STRING: 8, _ARRAY: 12}
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class _Bad(Exception):
    """A malformed field; turned into one LlmaccelError naming the file."""


class _Cursor:
    """Reads little-endian fields from a buffer, refusing to read past its end or its deadline."""

    def __init__(self, buf, deadline: float):
        self.buf, self.pos, self.size, self.deadline = buf, 0, len(buf), deadline
        self._ticks = 0

    def left(self) -> int:
        return self.size - self.pos

    def tick(self, n: int = 1) -> None:
        before, self._ticks = self._ticks, self._ticks + n
        if self._ticks > MAX_ITEMS:
            raise _Bad(f"header declares more than {MAX_ITEMS} metadata items")
        if before // 4096 != self._ticks // 4096 and time.monotonic() > self.deadline:
            raise _Bad(f"header not read within {CHECK_SECONDS:g} s")

    def skip_strings(self, n: int, what: str) -> None:
        """n length-prefixed strings (an array of tokens or merges): only their bounds."""
        self.tick(n)
        buf, pos, size, u64 = self.buf, self.pos, self.size, _U64.unpack_from
        for _ in range(n):
            if pos + 8 > size:
                raise _Bad(f"{what} runs past the end of the file")
            pos += 8 + u64(buf, pos)[0]
        if pos > size:
            raise _Bad(f"{what} runs past the end of the file")
        self.pos = pos

    def take(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if n > self.left():
            raise _Bad(f"{what} at byte {self.pos} runs past the end of the file")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def count(self, what: str, min_each: int) -> int:
        """A u64 count of items of at least min_each bytes, bounded by the bytes left."""
        n = self.take("<Q", what)
        if n * min_each > self.left():
            raise _Bad(f"{what} is {n}, more than the {self.left()} bytes left can hold")
        return n

    def string(self, what: str) -> str:
        n = self.count(f"length of {what}", 1)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} is not UTF-8") from None


def _gguf_value(cur: _Cursor, vtype: int, what: str, depth: int = 0):
    """Reads one value; returns it for scalars and strings, None for arrays (only bounded)."""
    cur.tick()
    if vtype in _GGUF_SCALAR:
        return cur.take(_GGUF_SCALAR[vtype], what)
    if vtype == _STRING:
        return cur.string(what)
    if vtype != _ARRAY:
        raise _Bad(f"{what} has unknown value type {vtype}")
    if depth > 2:
        raise _Bad(f"{what} nests arrays more than 2 deep")
    etype = cur.take("<I", f"element type of {what}")
    if etype not in _MIN_VALUE:
        raise _Bad(f"{what} has unknown element type {etype}")
    n = cur.count(f"element count of {what}", _MIN_VALUE[etype])
    if etype == _ARRAY and n > MAX_NESTED:
        raise _Bad(f"{what} is an array of {n} arrays (at most {MAX_NESTED} read)")
    if etype in _GGUF_SCALAR:  # fixed size: skip without reading each
        cur.pos += n * _MIN_VALUE[etype]
        return None
    if etype == _STRING:
        cur.skip_strings(n, what)
        return None
    for i in range(n):
        _gguf_value(cur, etype, f"{what}[{i}]", depth + 1)
    return None


def _gguf_tensor_sizes():
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}


def _check_gguf_extent(name, dims, size, offset, data_start, align, n_bytes) -> None:
    """A tensor's data whole blocks, aligned and inside the file's n_bytes."""
    block, type_size = size
    if dims[0] % block:
        raise _Bad(f"tensor {name}'s first dimension {dims[0]} is not a multiple of its "
                   f"block of {block}")
    n_elems = 1
    for d in dims:  # stops growing past the file size: no huge products
        n_elems *= d
        if n_elems // block * type_size > n_bytes:
            break
    end = data_start + offset + n_elems // block * type_size
    if offset % align or end > n_bytes:
        raise _Bad(f"tensor {name} (offset {offset}, shape {dims}) lies outside the file's "
                   f"{n_bytes} bytes")


def _check_gguf(buf, deadline: float) -> dict:
    cur = _Cursor(buf, deadline)
    if cur.left() < 24 or bytes(buf[:4]) != b"GGUF":
        raise _Bad("not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.take("<I", "version")
    if version not in GGUF_VERSIONS:
        hint = " (big-endian files are not read)" if version & 0xFFFF == 0 else ""
        raise _Bad(f"GGUF version {version} is not supported{hint}; supported: "
                   f"{', '.join(map(str, GGUF_VERSIONS))}")
    n_tensors = cur.count("tensor count", 8 + 4 + 4 + 8)
    n_kv = cur.count("metadata count", 8 + 4 + 1)
    if n_tensors > MAX_TENSORS or n_kv > MAX_KEYS:
        raise _Bad(f"{n_tensors} tensors and {n_kv} metadata keys declared; at most "
                   f"{MAX_TENSORS} and {MAX_KEYS} are read")
    meta: dict = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        if key in meta:
            raise _Bad(f"metadata key {key!r} appears twice")
        meta[key] = _gguf_value(cur, cur.take("<I", f"type of {key}"), key)
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _Bad(f"general.alignment {align!r} is not a power of two")
    sizes = _gguf_tensor_sizes()
    tensors, names = [], set()
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}")
        if name in names:
            raise _Bad(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = cur.take("<I", f"dimension count of {name}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise _Bad(f"tensor {name} has {n_dims} dimensions (1..{GGML_MAX_DIMS})")
        dims = [cur.take("<Q", f"dimension of {name}") for _ in range(n_dims)]
        ttype = cur.take("<I", f"type of {name}")
        offset = cur.take("<Q", f"offset of {name}")
        if ttype not in sizes:
            raise _Bad(f"tensor {name} has unknown type {ttype}")
        if min(dims) < 1:
            raise _Bad(f"tensor {name} has an empty dimension {dims}")
        tensors.append((name, dims, ttype, offset))
        cur.tick()
    data_start = -(-cur.pos // align) * align
    for name, dims, ttype, offset in tensors:
        _check_gguf_extent(name, dims, sizes[ttype], offset, data_start, align, len(buf))
    arch = meta.get("general.architecture")
    return {"version": version, "architecture": arch if isinstance(arch, str) else None,
            "tensors": n_tensors, "metadata": n_kv, "data_offset": data_start}


def _mapped(path: Path, check):
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise LlmaccelError(f"{path} is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return check(buf, time.monotonic() + CHECK_SECONDS)
    except _Bad as e:
        raise LlmaccelError(f"{path}: {e}") from None
    except OSError as e:
        raise LlmaccelError(f"cannot read {path}: {e.strerror or e}") from None


def check_gguf(path) -> dict:
    """Validate a GGUF header; returns its version, architecture and counts."""
    return _mapped(Path(path), _check_gguf)


def check_bytes(data: bytes, kind: str) -> dict:
    """check_gguf or check_safetensors (kind 'gguf' or 'safetensors') on bytes in memory."""
    check = _check_gguf if kind == "gguf" else _check_safetensors
    try:
        return check(data, time.monotonic() + CHECK_SECONDS)
    except _Bad as e:
        raise LlmaccelError(f"{kind}: {e}") from None


def _check_safetensors(buf, deadline: float) -> dict:
    cur = _Cursor(buf, deadline)
    n = cur.take("<Q", "header length")
    if n > min(cur.left(), SAFETENSORS_MAX_HEADER):
        raise _Bad(f"header length {n} is more than the file's {cur.left()} bytes (or 100 MB)")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (UnicodeDecodeError, ValueError) as e:
        raise _Bad(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _Bad("header is not a JSON object")
    data = len(buf) - 8 - n
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _Bad("__metadata__ is not an object of strings")
    for name, t in header.items():
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise _Bad(f"tensor {name!r}: expected dtype, shape and data_offsets")
        size = _ST_ITEMSIZE.get(t["dtype"]) if isinstance(t["dtype"], str) else None
        shape, offs = t["shape"], t["data_offsets"]
        if size is None:
            raise _Bad(f"tensor {name!r} has unknown dtype {t['dtype']!r}")
        if not isinstance(shape, list) or not all(_uint(d) for d in shape):
            raise _Bad(f"tensor {name!r} has a bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_uint(o) for o in offs)
                and offs[0] <= offs[1] <= data):
            raise _Bad(f"tensor {name!r}: data_offsets {offs!r} outside the {data} data bytes")
        n_elems = 1
        for d in shape:
            n_elems *= d
        if n_elems * size != offs[1] - offs[0]:
            raise _Bad(f"tensor {name!r}: shape {shape} of {t['dtype']} is {n_elems * size} bytes, "
                       f"its data_offsets span {offs[1] - offs[0]}")
        cur.tick()
    return {"tensors": len(header), "header_bytes": n}


def _uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_safetensors(path) -> dict:
    """Validate a safetensors header: length, JSON, every tensor's dtype, shape and offsets."""
    return _mapped(Path(path), _check_safetensors)


def load_safetensors(path, device: str = "cpu") -> dict:
    """Tensors of a safetensors file whose header was checked first; errors in one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_safetensors(path)
    try:
        tensors = load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise LlmaccelError(f"cannot read {path}: {e}") from None
    return {k: aligned(v) for k, v in tensors.items()}


ALIGN = 64  # bytes: a cache line, and what vectorized CPU kernels assume of their operands


def aligned(t):
    """`t`, or a copy of it at an aligned address. A CPU tensor loaded from a safetensors file
    starts where the header's offsets put it (any byte), and aten's CPU int8 weight-only GEMM
    faults on an unaligned int8 weight at 2+ rows (torch 2.13)."""
    if t.device.type != "cpu" or t.data_ptr() % ALIGN == 0 or t.numel() == 0:
        return t
    return t.clone()  # a fresh allocation: aligned by the allocator
