"""Bad values of the run flags: one line naming the flag typed, exit code 2, before any model
loads (each case here fails in well under a second)."""
import pytest
import torch

from tests.test_cli import assert_user_error

GEN = ["generate", "preset:tiny-llama", "--prompt", "x"]
BENCH = ["bench", "preset:tiny-llama", "--prompt-len", "4", "--gen-len", "3", "--warmup", "0", "--no-bw"]


@pytest.mark.parametrize("argv", [
    GEN, ["eval", "preset:tiny-llama"], BENCH, ["compile", "preset:tiny-llama", "-o", "{tmp}/a"],
    ["show", "preset:tiny-llama"], ["export", "preset:tiny-llama", "-o", "{tmp}/e"],
])
def test_cuda_without_cuda(capsys, monkeypatch, tmp_path, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_user_error(capsys, "--device 'cuda' needs CUDA, and torch finds no CUDA device here",
                      *[a.format(tmp=tmp_path) for a in argv], "--device", "cuda")
    assert not (tmp_path / "a").exists() and not (tmp_path / "e").exists()


def test_not_a_device(capsys):
    assert_user_error(capsys, "--device 'gpu0' is not a device", *GEN, "--device", "gpu0")
    assert_user_error(capsys, "--device 'meta' is not supported", *GEN, "--device", "meta")


@pytest.mark.parametrize("flag, value, match", [
    ("--temperature", "inf", "--temperature must be finite, got inf"),
    ("--temperature", "nan", "--temperature must be >= 0, got nan"),
    ("--temperature", "-1", "--temperature must be >= 0, got -1.0"),
    ("--top-p", "1.5", "--top-p must be in (0, 1], got 1.5"),
    ("--top-p", "0", "--top-p must be in (0, 1], got 0.0"),
    ("--top-p", "nan", "--top-p must be in (0, 1], got nan"),
    ("--top-k", "-3", "--top-k must be in 0..2147483647, got -3"),
])
@pytest.mark.parametrize("cmd", [GEN, BENCH], ids=["generate", "bench"])
def test_sampling_numbers(capsys, cmd, flag, value, match):
    assert_user_error(capsys, match, *cmd, flag, value)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_max_new_tokens_at_least_one(capsys, value):
    assert_user_error(capsys, f"--max-new-tokens must be >= 1, got {value}", *GEN, "--max-new-tokens", value)


@pytest.mark.parametrize("flag", ["--batch", "--prompt-len", "--gen-len"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_bench_sizes(capsys, flag, value):
    assert_user_error(capsys, f"{flag} must be >= 1, got {value}", *BENCH, flag, value)


@pytest.mark.parametrize("cmd", [GEN, BENCH], ids=["generate", "bench"])
def test_unknown_draft_names_the_flag(capsys, cmd):
    assert_user_error(capsys, "--speculative: unknown draft 'bogus'; use ngram, self", *cmd,
                      "--speculative", "bogus")


def test_unknown_draft_in_serve(capsys):
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    assert_user_error(capsys, "--speculative: unknown draft 'bogus'", "serve", "preset:tiny-llama",
                      "--port", "0", "--speculative", "bogus")


def test_unknown_baseline_names_the_flag(capsys, tmp_path):
    assert_user_error(capsys, "--baseline: unknown model 'bogus'; known: smollm2-135m", "eval",
                      "preset:tiny-llama", "--baseline", "bogus")
    assert_user_error(capsys, "--baseline: unknown model 'preset:nope'", "compile", "preset:tiny-llama",
                      "--baseline", "preset:nope", "-o", str(tmp_path / "a"))


def test_tensor_parallel_sizes(capsys):
    assert_user_error(capsys, "--tp must be >= 1, got 0", *GEN, "--tp", "0")
    assert_user_error(capsys, "--tp must be >= 1, got 0", *BENCH, "--tp", "0")
    # refused from the model's heads before any rank starts
    assert_user_error(capsys, "takes 1, 3", "generate", "preset:smollm2-135m", "--prompt", "x", "--tp", "2")
