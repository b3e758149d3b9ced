"""llmc bench on a tiny preset on the CPU: runs, prints one JSON line, rejects bad sizes."""
import json

import pytest

from llmaccel.cli import main as llmc
from llmaccel.bench.run import decode_timeline, kv_bytes_per_step, weight_bytes_per_step
from llmaccel.compiler.model import load

ARGS = ["preset:tiny-llama", "--batch", "2", "--prompt-len", "6", "--gen-len", "5", "--warmup", "1",
        "--json"]


def test_bench_prints_json(capsys):
    assert llmc(["bench", *ARGS]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert res["batch"] == 2 and res["prompt"] == 6 and res["gen"] == 5
    assert res["passes"] == ["fuse"] and res["device"] == "cpu" and res["engine"] == "LLM"
    assert res["decode_substeps"] >= 4  # the 4 tokens after the prefill's, in decode sub-steps
    for key in ("decode_tok_s", "prefill_tok_s", "tpot_ms", "peak_mem_bytes", "bytes_per_step"):
        assert res[key] > 0, key
    assert "decode" in out[1]


def test_bench_through_llmc_when_wired(capsys):
    from llmaccel import cli

    if "bench" not in cli.build_parser().format_help():
        pytest.skip("llmc bench is not wired into llmaccel/cli.py")
    assert cli.main(["bench", *ARGS, "--passes", ""]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["passes"] == []


def test_bench_runs_on_an_artifact_only_the_passes_it_lacks(capsys, tmp_path):
    from llmaccel.compiler.pipeline import compile

    art = tmp_path / "fused"
    compile("preset:tiny-llama", ["fuse"], eval_tokens=0, progress=False).save(art)
    short = [str(art), "--prompt-len", "4", "--gen-len", "2", "--warmup", "0", "--no-bw", "--json"]
    for extra in ([], ["--passes", ""]):  # the default --passes fuse is not run a second time
        assert llmc(["bench", *short, *extra]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert json.loads(out[-1])["passes"] == ["fuse"] and "(passes: fuse;" in out[0]
    assert llmc(["bench", *short, "--set", "fuse.norms=false"]) == 2
    assert "has run fuse already" in capsys.readouterr().err


def test_bench_rejects_bad_sizes(capsys):
    assert llmc(["bench", "preset:tiny-llama", "--batch", "0", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("llmc: error:") and "--batch" in err[0]
    assert llmc(["bench", "preset:tiny-llama", "--prompt-len", "500", "--gen-len", "100"]) == 2
    assert "exceeds" in capsys.readouterr().err


@pytest.mark.parametrize("src", ["preset:tiny-llama", "preset:tiny-gpt2"])
def test_bytes_per_step(src):
    m = load(src)
    c = m.config
    total = sum(p.numel() * 4 for p in m.gm.parameters())
    # a table only the embedding reads is read a row at a time (an untied embedding, GPT-2's
    # positions); a tied one is read in full by the LM head
    skip = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size * 4
    skip += c.max_position * c.hidden_size * 4 if c.family == "gpt2" else 0
    assert weight_bytes_per_step(m.gm) == total - skip
    assert kv_bytes_per_step(m.gm, 3, 10, 2) == c.n_layers * 2 * 3 * c.n_kv_heads * c.head_dim * 10 * 2


def test_decode_timeline_splits_busy_and_idle():
    # prefill ends at 10; two decode steps: overlapping kernels (PDL) count once, the gaps
    # after the memcpy are where the GPU waited for the host
    acts = [("_paged_prefill_kernel", 0.0, 10.0), ("gemv", 10.0, 5.0), ("attn", 14.0, 4.0),
            ("Memcpy DtoH", 18.0, 1.0), ("gemv", 25.0, 5.0), ("attn", 30.0, 2.0),
            ("Memcpy DtoH", 32.0, 1.0), ("gemv", 36.0, 4.0)]
    t = decode_timeline(acts, steps=2)
    assert t["decode_wall_ms_per_step"] == pytest.approx(30.0 / 1e3 / 2)
    assert t["decode_busy_ms_per_step"] == pytest.approx(21.0 / 1e3 / 2)
    assert t["decode_idle_ms_per_step"] == pytest.approx(9.0 / 1e3 / 2)
    top = t["decode_idle_gaps"][0]
    assert (top["after"], top["before"], top["count"], top["us_per_step"]) == ("Memcpy DtoH", "gemv", 2, 4.5)
    assert decode_timeline([], 3) == {}
