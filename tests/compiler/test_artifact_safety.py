"""Artifacts are written whole or not at all, refused over other files, and checked on load."""
import errno
import json
import os

import pytest
import torch

from llmaccel import cli
from llmaccel.compiler import atomic, pipeline
from llmaccel.compiler.model import load
from llmaccel.errors import LlmaccelError


@pytest.fixture(scope="module")
def tiny():
    return load("preset:tiny-llama")


@pytest.fixture(scope="module")
def other():
    """A model whose artifact differs from tiny's (its recipe)."""
    m = load("preset:tiny-llama")
    m.recipe = [{"name": "other"}]
    return m


@pytest.fixture
def art(tmp_path, tiny):
    tiny.save(tmp_path / "a")
    return tmp_path / "a"


def _one_error_line(capsys, *argv) -> str:
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("llmc: error:"), err
    return lines[0]


def _same_model(a, b) -> None:
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(a.logits(ids), b.logits(ids), rtol=0, atol=0)


def test_output_checked_before_any_work(capsys, tmp_path, art, monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled before checking -o")
    monkeypatch.setattr(pipeline, "compile", no_compile)
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("x")
    assert "is an existing file" in _one_error_line(capsys, "compile", "preset:tiny-llama", "-o", str(tmp_path / "f"))
    assert "not an llmaccel artifact" in _one_error_line(capsys, "compile", "preset:tiny-llama", "-o", str(tmp_path / "d"))
    assert "holds an artifact already; --force replaces it" in _one_error_line(
        capsys, "compile", "preset:tiny-llama", "-o", str(art))
    assert (tmp_path / "f").read_text() == "x" and os.listdir(tmp_path / "d") == ["notes.txt"]


def test_force_replaces_an_artifact_and_an_empty_folder_is_used(capsys, tmp_path, art):
    assert cli.main(["compile", "preset:tiny-gpt2", "-o", str(art), "--force"]) == 0
    assert load(str(art)).config.family == "gpt2"
    (tmp_path / "empty").mkdir()
    assert cli.main(["compile", "preset:tiny-gpt2", "-o", str(tmp_path / "empty")]) == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_python_save_refuses_an_artifact_unless_force(art, tiny):
    with pytest.raises(LlmaccelError, match="force=True replaces it"):
        tiny.save(art)
    tiny.save(art, force=True)


@pytest.mark.parametrize("exc, match", [
    (KeyboardInterrupt(), None),
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device; the previous"),
])
def test_interrupted_or_full_disk_write_leaves_the_old_artifact(tmp_path, art, tiny, other, monkeypatch, exc,
                                                                 match):
    """The failure comes after model.safetensors of the new artifact is written."""
    from llmaccel.compiler import artifact

    before = {p.name: p.read_bytes() for p in art.iterdir()}
    real = artifact.versions

    def fail():
        real()
        raise exc
    monkeypatch.setattr(artifact, "versions", fail)
    with pytest.raises(type(exc) if match is None else LlmaccelError, match=match):
        other.save(art, force=True)
    assert {p.name: p.read_bytes() for p in art.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # the temporary folder is gone
    _same_model(load(str(art)), tiny)


def test_swap_without_renameat2(art, other, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    other.save(art, force=True)
    assert load(str(art)).recipe[0]["name"] == "other"
    assert [p.name for p in art.parent.iterdir()] == ["a"]


def test_stale_temporary_folders_of_dead_writers_are_removed(tmp_path, art, tiny):
    dead = tmp_path / ".a.llmc-999999999-00000000"  # no such pid
    live = tmp_path / f".a.llmc-{os.getpid()}-11111111"
    dead.mkdir()
    live.mkdir()
    tiny.save(art, force=True)
    assert not dead.exists() and live.exists()


def test_manifest_records_every_file(art):
    man = json.loads((art / "manifest.json").read_text())
    names = {p.name for p in art.iterdir()} - {"manifest.json"}
    assert set(man["files"]) == names
    assert man["files"]["model.safetensors"]["size"] == (art / "model.safetensors").stat().st_size


@pytest.mark.parametrize("damage, match", [
    (lambda p: p.unlink(), "is missing model.safetensors (listed in its manifest)"),
    (lambda p: p.write_bytes(p.read_bytes()[:1000]), "model.safetensors is damaged: 1000 bytes where the manifest records"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + b"\x01"), "model.safetensors is damaged: its SHA-256 differs"),
])
def test_damaged_weights_named_in_one_line(capsys, art, damage, match):
    damage(art / "model.safetensors")
    assert match in _one_error_line(capsys, "show", str(art), "--counts-only")


def test_artifact_without_file_records_still_loads_and_its_weights_are_checked(art, tiny):
    man = json.loads((art / "manifest.json").read_text())
    del man["files"]
    (art / "manifest.json").write_text(json.dumps(man))
    _same_model(load(str(art)), tiny)
    (art / "model.safetensors").write_bytes((art / "model.safetensors").read_bytes()[:3000])
    with pytest.raises(LlmaccelError, match="outside the .* data bytes"):
        load(str(art))


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(format_version="1"), "format_version is '1', not a positive integer"),
    (lambda m: m["config"].update(n_kv_heads=0), "n_kv_heads must be a positive integer"),
    (lambda m: m["config"].update(hidden_size="64"), "config.hidden_size is '64', not a int"),
    (lambda m: m["config"].pop("vocab_size"), "config has no vocab_size"),
    (lambda m: m.update(graph={}), "graph is not a non-empty list"),
    (lambda m: m["graph"][3].pop("kwargs"), "graph node 3 is malformed"),
    (lambda m: m["graph"][5].update(args=[{"node": "nope"}]), "undefined node 'nope'"),
    (lambda m: m["graph"][5].update(args=[{"dtype": "load"}]), "is malformed"),
    (lambda m: next(n for n in m["graph"] if n["op"] == "call_function").update(target="torch.load"),
     "file-reading or -writing target: torch.load"),
    (lambda m: m.update(files={"../x": {"size": 1, "sha256": "0"}}), "files is not an object"),
])
def test_manifest_fields_type_checked(art, edit, match):
    man = json.loads((art / "manifest.json").read_text())
    edit(man)
    (art / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(LlmaccelError, match=match.replace("(", r"\(").replace(")", r"\)")):
        load(str(art))


def test_missing_graph_weight_named(art):
    from safetensors.torch import load_file, save_file

    w = load_file(str(art / "model.safetensors"))
    w.pop("norm.weight")
    save_file(w, str(art / "model.safetensors"))
    man = json.loads((art / "manifest.json").read_text())
    del man["files"]
    (art / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(LlmaccelError, match="reads 1 weights that model.safetensors lacks \\(norm.weight\\)"):
        load(str(art))
