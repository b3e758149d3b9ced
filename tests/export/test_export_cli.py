"""`llmc export`, and `llmc eval` on an exported folder; bad input is one line, exit 2."""
import json

import pytest

from llmaccel import cli
from llmaccel.compiler.pipeline import compile


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_export_then_eval_the_folder_as_the_source(capsys, tmp_path):
    out = tmp_path / "onnx"
    code, text, err = run(capsys, "export", "preset:tiny-llama", "--format", "onnx", "-o", str(out))
    assert code == 0 and (out / "model.onnx.data").exists(), err
    args = ["--text", "self", "--max-tokens", "96", "--ctx", "32", "--json"]
    code, text, err = run(capsys, "eval", str(out), *args)
    assert code == 0, err
    got = json.loads(text.splitlines()[-1])
    code, text, err = run(capsys, "eval", "preset:tiny-llama", "--device", "cpu", "--dtype", "float32", *args)
    want = json.loads(text.splitlines()[-1])
    assert got["tokens"] == want["tokens"] == 96 - 1
    assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-5)


@pytest.mark.parametrize("argv,match", [
    (["--format", "onnx", "--dtype", "bfloat16"], "float32 or float16"),
    (["--format", "onnx"], "'kv_quant_attention' has no ONNX translation"),
])
def test_bad_exports_are_one_line(capsys, tmp_path, argv, match):
    art = tmp_path / "kvq"
    compile("preset:tiny-llama", ["kvquant"], {}, progress=False, eval_tokens=0).save(art)
    code, out, err = run(capsys, "export", str(art), "-o", str(tmp_path / "out"), *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and match in lines[0], err


def _one_line_error(capsys, argv, match):
    code, out, err = run(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and match in lines[0] and "Traceback" not in err, err


def test_export_output_is_refused_or_replaced_as_compile_does(capsys, tmp_path, monkeypatch):
    from llmaccel.export import exporter

    out = tmp_path / "e"
    argv = ["export", "preset:tiny-llama", "--format", "onnx", "-o", str(out)]
    (tmp_path / "file").write_text("x")
    _one_line_error(capsys, argv[:-1] + [str(tmp_path / "file")], "is an existing file")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    _one_line_error(capsys, argv[:-1] + [str(tmp_path / "other")], "not an llmaccel export")
    _one_line_error(capsys, argv[:-1] + [str(tmp_path / "other"), "--force"], "not an llmaccel export")
    assert run(capsys, *argv)[0] == 0
    _one_line_error(capsys, argv, "holds an export already; --force replaces it")

    def killed(*a, **k):  # the process ends mid-export, after the weights were written
        raise KeyboardInterrupt
    monkeypatch.setattr(exporter.onnx.checker, "check_model", killed)
    assert run(capsys, *argv[:3], "genai", *argv[4:], "--force")[0] == 130
    assert json.loads((out / "llmaccel_export.json").read_text())["format"] == "onnx"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "file", "other"]  # no temporary left
    monkeypatch.undo()
    assert run(capsys, *argv[:3], "genai", *argv[4:], "--force")[0] == 0
    assert json.loads((out / "llmaccel_export.json").read_text())["format"] == "genai"
    assert (out / "genai_config.json").exists()
