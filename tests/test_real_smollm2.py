"""The real SmolLM2-135M against transformers (fp32, CPU): perplexity, greedy text, a known fact."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmaccel import cli
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.eval.perplexity import evaluate
from llmaccel.eval.text import file_tokens
from llmaccel.sampling import SamplingParams

pytestmark = pytest.mark.real
WIKI = Path(__file__).resolve().parents[1] / "llmaccel" / "data" / "wikitext2" / "wiki.test.raw"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of",
           "In 1969, the first humans", "To make a cup of tea, you", "Machine learning is a field that"]


@pytest.fixture(scope="module")
def model():
    return load("smollm2-135m")


@pytest.fixture(scope="module")
def hf(model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model.tokenizer_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_ppl(hf, ids, ctx=512):
    nll, n = 0.0, 0
    for s in range(0, len(ids) - 1, ctx):
        y = ids[s + 1: s + ctx + 1]
        nll += F.cross_entropy(hf(ids[s: s + len(y)][None]).logits[0].float(), y, reduction="sum").item()
        n += len(y)
    return math.exp(nll / n)


def test_wikitext_ppl_matches_transformers(model, hf):
    if not WIKI.exists():
        pytest.skip(f"{WIKI} not present")
    ids = file_tokens(model, str(WIKI), "second-half", 2048)
    ours = evaluate(model, ids, ctx=512, progress=False)
    ref = hf_ppl(hf, ids)
    assert ours["tokens"] == 2047
    assert abs(ours["ppl"] / ref - 1) < 1e-3, (ours["ppl"], ref)
    assert abs(ref - 28.29) < 0.05  # 4,096 tokens: 27.15; 8,192: 26.33; 16,384: 28.80


def test_fuse_artifact_keeps_wikitext_ppl(model, tmp_path):
    if not WIKI.exists():
        pytest.skip(f"{WIKI} not present")
    ids = file_tokens(model, str(WIKI), "second-half", 2048)
    want = evaluate(model, ids, ctx=512, progress=False)["ppl"]
    fused = compile("smollm2-135m", ["fuse"], eval_tokens=0, progress=False)
    fused.save(tmp_path / "fuse")
    art = load(str(tmp_path / "fuse"))
    got = evaluate(art, ids, ctx=512, progress=False)["ppl"]
    assert abs(got / want - 1) < 1e-4, (got, want)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuations_match_transformers(model, hf, prompt):
    ids = model.encode(prompt)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=2)[0, len(ids):].tolist()
    ours = list(model.generate_ids(ids, SamplingParams(max_tokens=32, ignore_eos=True)))
    assert ours == ref, prompt


def test_generate_says_paris(capsys):
    assert cli.main(["generate", "smollm2-135m", "--prompt", "The capital of France is",
                     "--temperature", "0", "--max-new-tokens", "8"]) == 0
    assert "Paris" in capsys.readouterr().out
