"""Mutated GGUF, safetensors and manifest files: every one loads or fails in one LlmaccelError
line within 5 s; never a hang, a traceback or a crash. scripts/fuzz_loaders.py runs the same
targets on thousands of files."""
import signal
import struct
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import fuzz_targets as F  # noqa: E402

LIMIT_S = 5
SETTINGS = dict(deadline=LIMIT_S * 1000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def edits(hot: int):
    return st.lists(st.tuples(st.sampled_from(F.OPS), st.integers(0, hot - 1),
                              st.binary(min_size=1, max_size=16)), min_size=1, max_size=4)


@contextmanager
def time_limit():
    """A hang becomes a failure instead of a stuck test run."""
    def stop(*_):
        raise TimeoutError(f"a case ran over {LIMIT_S} s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    d = tmp_path_factory.mktemp("seeds")
    gguf = F.tiny_gguf(d / "small.gguf").read_bytes()
    hf = F.tiny_hf_dir(d / "hf")
    art = F.tiny_artifact(d / "art")
    return {"gguf": gguf, "hf": hf, "st": (hf / "model.safetensors").read_bytes(), "art": art,
            "manifest": (art / "manifest.json").read_bytes(), "work": d}


def test_seeds_load(seeds):
    assert F.load_gguf(Path(seeds["work"] / "small.gguf")) == "ok"
    assert F.load_hf(seeds["hf"]) == "ok"
    assert F.load_artifact(seeds["art"]) == "ok"


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_mutated_small_gguf(seeds, data):
    raw = seeds["gguf"]
    p = seeds["work"] / "m.gguf"
    p.write_bytes(F.apply_edits(raw, data.draw(edits(F.header_end(raw, "gguf")))))
    with time_limit():
        assert F.load_gguf(p) in ("ok", "error")


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_mutated_safetensors_in_an_hf_folder(seeds, data):
    raw = seeds["st"]
    d = seeds["work"] / "hf-m"
    if not d.exists():
        F.copy_folder(seeds["hf"], d)
    (d / "model.safetensors").write_bytes(F.apply_edits(raw, data.draw(edits(F.header_end(raw, "safetensors")))))
    with time_limit():
        assert F.load_hf(d) in ("ok", "error")


@settings(max_examples=100, **SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_mutated_manifest(seeds, seed):
    import random

    d = seeds["work"] / "art-m"
    if not d.exists():
        F.copy_folder(seeds["art"], d)
    (d / "manifest.json").write_bytes(F.mutate_manifest(seeds["manifest"], random.Random(seed)))
    with time_limit():
        assert F.load_artifact(d) in ("ok", "error")


@pytest.mark.real
@settings(max_examples=8, **SETTINGS)
@given(data=st.data())
def test_mutated_real_gguf_header(seeds, data):
    """The SmolLM2 GGUF's metadata mutated, its tensor data a sparse run of zeros."""
    from llmaccel.compiler.filecheck import check_gguf

    real = F.real_gguf()
    hot = check_gguf(real)["data_offset"]
    with open(real, "rb") as f:
        head = f.read(hot)
    mut = F.apply_edits(head, data.draw(edits(hot)))
    p = seeds["work"] / "real-m.gguf"
    with open(p, "wb") as f:
        f.write(mut)
        f.truncate(len(mut) + real.stat().st_size - hot)
    with time_limit():
        assert F.load_gguf(p, reader=False) in ("ok", "error")


def test_gguf_declaring_an_array_of_2_63_elements_fails_at_once(tmp_path, capsys):
    """A few bytes that make gguf 0.19's reader loop for ever."""
    from llmaccel import cli

    p = tmp_path / "hang.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 3) + b"abc"
                  + struct.pack("<II", 9, 0) + struct.pack("<Q", 2**63))
    with time_limit():
        code = cli.main(["show", str(p)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "element count of abc is 9223372036854775808, more than the 0 bytes left" in lines[0]


def test_bounds_hold_whatever_the_header_declares(tmp_path):
    """Headers that declare the most work the bounds allow, in a 100 MB file of zeros: each
    check ends in about a second or less."""
    import time

    from llmaccel.compiler.filecheck import check_gguf
    from llmaccel.errors import LlmaccelError

    key = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 3) + b"abc"
    cases = [key + struct.pack("<IIQ", 9, 8, (1 << 20) - 2),  # a million empty strings: read
             key + struct.pack("<IIQ", 9, 8, 1 << 21),  # over the item bound: refused at once
             key + struct.pack("<IIQ", 9, 9, 1 << 17),  # too many arrays of arrays
             b"GGUF" + struct.pack("<IQQ", 3, 1 << 30, 1)]  # too many tensors
    for i, head in enumerate(cases):
        p = tmp_path / f"w{i}.gguf"
        with open(p, "wb") as f:
            f.write(head)
            f.truncate(100_000_000)
        t0 = time.perf_counter()
        try:
            check_gguf(p)
        except LlmaccelError:
            pass
        assert time.perf_counter() - t0 < 3.5


@pytest.mark.parametrize("header, match", [
    (struct.pack("<Q", 2**62), "header length 4611686018427387904 is more than"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    (struct.pack("<Q", 60) + b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 2**9]}}'[:60],
     "not valid JSON"),
])
def test_safetensors_headers_bounded(tmp_path, header, match):
    from llmaccel.compiler.filecheck import load_safetensors
    from llmaccel.errors import LlmaccelError

    p = tmp_path / "w.safetensors"
    p.write_bytes(header + b"\0" * 16)
    with pytest.raises(LlmaccelError, match=match):
        load_safetensors(p)


def test_safetensors_offsets_and_sizes_checked(tmp_path):
    import json

    from llmaccel.compiler.filecheck import load_safetensors
    from llmaccel.errors import LlmaccelError

    def write(meta, data=b"\0" * 16):
        h = json.dumps(meta).encode()
        (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + data)
        return tmp_path / "w.safetensors"

    with pytest.raises(LlmaccelError, match="outside the 16 data bytes"):
        load_safetensors(write({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}))
    with pytest.raises(LlmaccelError, match="shape \\[3\\] of F32 is 12 bytes, its data_offsets span 16"):
        load_safetensors(write({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}))
    with pytest.raises(LlmaccelError, match="unknown dtype 'F33'"):
        load_safetensors(write({"w": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}))
    assert load_safetensors(write({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}))["w"].shape == (4,)
