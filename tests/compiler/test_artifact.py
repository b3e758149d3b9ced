import json
import zipfile

import pytest
import torch

from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError


@pytest.mark.parametrize("src", ["preset:tiny-llama", "preset:tiny-gpt2"])
def test_artifact_round_trip_rebuilds_the_graph(tmp_path, src):
    m = compile(src, ["fuse"], progress=False)
    m.save(tmp_path / "a", m.report)
    files = {p.name for p in (tmp_path / "a").iterdir()}
    assert {"manifest.json", "model.safetensors", "report.md", "report.json"} <= files
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert man["format_version"] == 1 and man["recipe"][0]["name"] == "fuse"
    assert "torch" in man["versions"]
    m2 = load(str(tmp_path / "a"))
    assert m2.op_counts() == m.op_counts()
    assert m2.recipe[0]["stats"] == m.report["passes"][0]["stats"]
    ids = torch.randint(0, 512, (2, 17))
    torch.testing.assert_close(m2.logits(ids), m.logits(ids), rtol=0, atol=0)


def test_artifact_holds_no_pickle(tmp_path):
    m = compile("preset:tiny-llama", ["fuse"], progress=False)
    m.save(tmp_path / "a")
    for p in (tmp_path / "a").iterdir():
        assert not zipfile.is_zipfile(p), p  # torch.save writes zip archives of pickles
        assert not p.read_bytes().startswith(b"\x80"), p  # raw pickle protocol header


def test_newer_artifact_format_is_refused(tmp_path):
    m = load("preset:tiny-llama")
    m.save(tmp_path / "a")
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    man["format_version"] = 99
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(LlmaccelError, match="artifact format 99.*upgrade llmaccel"):
        load(str(tmp_path / "a"))


def test_artifact_target_outside_allowlist_is_refused(tmp_path):
    m = load("preset:tiny-llama")
    m.save(tmp_path / "a")
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    node = next(n for n in man["graph"] if n["op"] == "call_function")
    node["target"] = "os.system"
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(LlmaccelError, match="outside the allowed modules"):
        load(str(tmp_path / "a"))
