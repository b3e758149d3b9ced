"""A core install (no extras): compile, eval, generate and bench run; a command that needs an
extra fails in one line naming it, exit 2. The CLI runs in a subprocess in which the extras'
modules cannot be imported, as on a machine that never installed them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "compiler"))
from fuzz_targets import tiny_hf_dir  # noqa: E402

# The import names of what pyproject.toml's extras install (plot, onnx, dev, serve, fuzz)
EXTRAS_MODULES = ("matplotlib", "onnx", "onnxscript", "onnxruntime", "onnxruntime_genai", "triton",
                  "fastapi", "uvicorn", "httptools", "uvloop", "prometheus_client", "httpx", "aiohttp",
                  "openai", "hypothesis", "atheris")
# None in sys.modules makes `import X` raise ImportError, and find_spec(X) (which transformers
# and torch probe with) answer None
BOOT = ("import sys\n"
        f"sys.modules.update(dict.fromkeys({EXTRAS_MODULES!r}))\n"
        "from llmaccel.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
WIKI = str(Path(__file__).parents[1] / "llmaccel" / "data" / "wikitext2" / "wiki.test.raw")


def llmc_core(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BOOT, *map(str, argv)], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory) -> Path:
    """preset:tiny-llama as an HF folder with a word-level tokenizer: presets have none, and
    `llmc generate` takes a text prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tiny_hf_dir(tmp_path_factory.mktemp("tiny") / "hf")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hi": 3, **{f"w{i}": i for i in range(4, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "bos_token": "<s>",
        "eos_token": "</s>"}))
    return d


@pytest.mark.parametrize("argv", [
    ["eval", "preset:tiny-llama", "--text", WIKI, "--max-tokens", "256"],
    ["compile", "preset:tiny-llama", "--passes", "fuse", "-o", "{tmp}/art"],
    ["bench", "preset:tiny-llama", "--batch", "1", "--prompt-len", "8", "--gen-len", "4", "--no-bw"],
    ["generate", "{hf}", "--prompt", "hi", "--max-new-tokens", "4", "--temperature", "0"],
], ids=lambda argv: argv[0])
def test_core_commands_run_without_the_extras(argv, tmp_path, request):
    hf = request.getfixturevalue("tiny_with_tokenizer") if "{hf}" in argv else None
    r = llmc_core(*(a.format(tmp=tmp_path, hf=hf) for a in argv))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr


def _export_folder(tmp_path) -> Path:
    """What marks a folder as an export (llmaccel/export/folder.py); running it needs onnxruntime
    before any file in it is read."""
    d = tmp_path / "exported"
    d.mkdir()
    for name in ("llmaccel_export.json", "model.onnx"):
        (d / name).write_text("{}")
    return d


@pytest.mark.parametrize("argv,line", [
    (["export", "preset:tiny-llama", "-o", "{tmp}/out"],
     "llmc: error: llmc export needs the onnx extra (onnx is missing): pip install 'llmaccel[onnx]'"),
    (["serve", "preset:tiny-llama", "--port", "0"],
     "llmc: error: llmc serve needs the serve extra (fastapi is missing): pip install 'llmaccel[serve]'"),
    (["generate", "{export}", "--prompt", "hi"],
     "llmc: error: running an exported ONNX folder needs the onnx extra (onnxruntime is missing): "
     "pip install 'llmaccel[onnx]'"),
], ids=["export", "serve", "generate-export"])
def test_commands_that_need_an_extra_name_it_in_one_line(argv, line, tmp_path):
    export = _export_folder(tmp_path) if "{export}" in argv else None
    r = llmc_core(*(a.format(tmp=tmp_path, export=export) for a in argv))
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [line]
    assert not (tmp_path / "out").exists()
