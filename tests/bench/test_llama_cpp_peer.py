"""`llmc bench --peer llama.cpp`: its argument checked before anything runs, a missing
llama-cpp-python named as the extra that installs it, and (where it is installed) figures from a
real run on the built-in model's GGUF."""
import importlib.util
import subprocess
import sys

import pytest

from llmaccel.bench.llama_cpp_peer import parse_peer, peer_gguf
from llmaccel.errors import LlmaccelError


def test_peer_arguments_are_checked():
    assert parse_peer(None) is None
    assert parse_peer("llama.cpp") == ("llama.cpp", None)
    assert parse_peer("llama.cpp:Q8_0") == ("llama.cpp", "Q8_0")
    assert parse_peer("llama.cpp:/x/m.gguf") == ("llama.cpp", "/x/m.gguf")
    for bad in ("vllm", "llama.cpp:Q3_XYZ"):
        with pytest.raises(LlmaccelError):
            parse_peer(bad)
    with pytest.raises(LlmaccelError, match="no such file"):
        peer_gguf("smollm2-135m", "/nonexistent/m.gguf")
    with pytest.raises(LlmaccelError, match="needs a GGUF"):
        peer_gguf("preset:tiny-llama", None)


def test_a_missing_llama_cpp_python_is_one_line_naming_the_extra(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_llama(name, *a, **kw):
        if name == "llama_cpp":
            raise ImportError("no llama_cpp", name="llama_cpp")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_llama)
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    from llmaccel.bench.run import bench
    with pytest.raises(LlmaccelError, match=r"pip install 'llmaccel\[llamacpp\]'"):
        bench("preset:tiny-llama", device="cpu", gen_len=2, peer=("llama.cpp", None))


@pytest.mark.real
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llama_cpp_runs_beside_llm_on_the_builtin_gguf():
    from llmaccel.bench.llama_cpp_peer import run_llama_cpp
    r = run_llama_cpp(peer_gguf("smollm2-135m", None), [[5] * 16], gen_len=8, warmup=0)
    assert r["peer"] == "llama.cpp" and r["decode_tok_s"] > 0 and 0 < r["ttft_s"]
    out = subprocess.run([sys.executable, "-m", "llmaccel.bench", "preset:tiny-llama", "--device", "cpu",
                          "--gen-len", "2", "--peer", "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown peer" in out.stderr
