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


def test_a_loaded_w8_artifact_is_aligned_and_prefills_on_the_cpu(tmp_path):
    """Tensors of a safetensors file start at any byte; aten's CPU int8 weight-only GEMM faulted
    (SIGSEGV) on such an int8 weight at 2+ rows, so `llmc generate` of every W8 artifact died in
    its first prefill. Loading copies unaligned tensors to aligned memory."""
    from llmaccel import LLM, SamplingParams
    from llmaccel.compiler.filecheck import ALIGN

    m = compile("preset:tiny-llama", ["fuse", "quant"], {"quant": {"bits": "8", "method": "rtn"}},
                eval_tokens=0, progress=False)
    m.save(tmp_path / "w8")
    back = load(str(tmp_path / "w8"))
    assert all(t.data_ptr() % ALIGN == 0 for t in back.gm.state_dict().values())
    q = next(t for t in back.gm.state_dict().values() if t.dtype == torch.int8)
    torch.ops.aten._weight_int8pack_mm(torch.randn(6, q.shape[1]).bfloat16(), q,
                                       torch.ones(q.shape[0], dtype=torch.bfloat16))
    llm = LLM(str(tmp_path / "w8"), device="cpu", compile=False)
    out = llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
