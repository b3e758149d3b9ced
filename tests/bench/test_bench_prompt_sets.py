"""llmc bench --prompts: requests take the prompt sets of eval/prompts.py in turn."""
import json

from llmaccel.bench.run import render
from llmaccel.cli import main as llmc
from llmaccel.eval.prompts import GROUNDED

# no compile, no warm-up: the figures do not matter here, only what ran
FAST = ["preset:tiny-llama", "--gen-len", "3", "--warmup", "0", "--no-bw", "--compile", "off",
        "--passes", "", "--json"]


def test_bench_runs_the_grounded_set_and_reports_it(capsys):
    assert llmc(["bench", *FAST, "--batch", "3", "--prompts", "grounded", "--speculative", "ngram"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    # a preset reads the text as bytes: request i has prompt i's length
    mean = sum(len(p.encode()) for p in GROUNDED[:3]) / 3
    assert res["prompt_set"] == "grounded" and res["prompt_tokens_mean"] == mean
    assert res["prompt"] == round(mean) and res["batch"] == 3 and res["speculative"] == "ngram"
    assert "prompts grounded (mean" in out[0] and render(res).splitlines()[0] == out[0]


def test_random_stays_the_default_and_a_set_excludes_prompt(capsys):
    assert llmc(["bench", *FAST, "--prompt-len", "6"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["prompt_set"] == "random" and res["prompt"] == 6 and res["prompt_tokens_mean"] == 6
    assert llmc(["bench", *FAST, "--prompts", "open", "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prompt and --prompts open" in err[0]
