import math

import pytest
import torch
import torch.nn.functional as F

from llmaccel.compiler.model import load
from llmaccel.eval.perplexity import evaluate
from llmaccel.eval.text import read_split, sampled_tokens
from llmaccel.errors import LlmaccelError


def test_windows_and_ppl_match_a_direct_computation():
    m = load("preset:tiny-llama")
    ids = torch.randint(0, 512, (70,))
    res = evaluate(m, ids, ctx=32, progress=False)
    nll, n = 0.0, 0
    for s in (0, 32, 64):  # predict ids[s+1 : s+33] from ids[s : s+32]; the last window is short
        y = ids[s + 1: s + 33]
        lo = m.logits(ids[s: s + len(y)][None])[0]
        nll += F.cross_entropy(lo, y, reduction="sum").item()
        n += len(y)
    assert res["tokens"] == n == 69 and res["windows"] == 3
    assert res["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-6)


def test_baseline_against_itself_has_zero_kl():
    m = load("preset:tiny-gpt2")
    res = evaluate(m, torch.randint(0, 512, (40,)), ctx=16, baseline=load("preset:tiny-gpt2"), progress=False)
    assert res["kl"] == pytest.approx(0.0, abs=1e-6) and res["top1"] == 1.0
    assert res["baseline_ppl"] == pytest.approx(res["ppl"], rel=1e-6)


def test_baseline_ppl_equals_its_own_evaluation():
    ids = torch.randint(0, 512, (50,))
    res = evaluate(load("preset:tiny-llama"), ids, ctx=16, baseline=load("preset:tiny-gpt2"), progress=False)
    alone = evaluate(load("preset:tiny-gpt2"), ids, ctx=16, progress=False)
    assert res["baseline_ppl"] == pytest.approx(alone["ppl"], rel=1e-6)


def test_self_text_is_seeded_and_sized():
    m = load("preset:tiny-llama")
    a = sampled_tokens(m, 50, seq_len=16, seed=3)
    b = sampled_tokens(m, 50, seq_len=16, seed=3)
    assert a.shape == (50,) and torch.equal(a, b)
    assert not torch.equal(a, sampled_tokens(m, 50, seq_len=16, seed=4))


def test_split_by_characters_without_newline_translation(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"ab\r\ncd\r\n")
    assert read_split(str(p), "all") == "ab\r\ncd\r\n"
    assert read_split(str(p), "first-half") == "ab\r\n"
    with pytest.raises(LlmaccelError, match="no such text file"):
        read_split(str(tmp_path / "missing.txt"), "all")


def test_a_preset_reads_text_files_as_utf8_bytes(tmp_path):
    """A model without a tokenizer (a preset) calibrates and evaluates on a text file's UTF-8
    bytes, as the domain evaluation reads its texts; a split still cuts by characters."""
    from llmaccel.eval.text import load_tokens

    f = tmp_path / "t.txt"
    f.write_text("héllo wörld\nsecond half", encoding="utf-8")
    m = load("preset:tiny-llama")
    ids = load_tokens(m, str(f), "all", None)
    assert ids.tolist() == list("héllo wörld\nsecond half".encode("utf-8"))
    assert load_tokens(m, str(f), "first-half", 4).tolist() == list(b"h\xc3\xa9l")


def test_a_model_without_tokenizer_and_under_256_ids_reads_no_text(tmp_path):
    """Bytes would be ids out of range of a vocabulary under 256: one clear error instead."""
    import dataclasses

    from llmaccel.eval.text import load_tokens

    f = tmp_path / "t.txt"
    f.write_text("some text", encoding="utf-8")
    m = load("preset:tiny-llama")
    m.config = dataclasses.replace(m.config, vocab_size=200)
    with pytest.raises(LlmaccelError, match="fewer than 256 token ids"):
        load_tokens(m, str(f), "all", None)


def test_a_model_without_a_tokenizer_that_is_no_preset_warns_it_reads_bytes(tmp_path):
    """Only presets are expected to lack a tokenizer: any other model read as bytes says so."""
    from llmaccel.eval.text import text_encoder

    m = load("preset:tiny-llama")
    m.source = str(tmp_path / "artifact")
    with pytest.warns(UserWarning, match="read as UTF-8 bytes"):
        assert text_encoder(m)("ab") == [97, 98]


def test_a_model_past_exp_range_reports_inf_ppl_not_an_error():
    """A broken model (a mean NLL over ~710 nats a token) has perplexity inf: exp overflows a
    float, and that is a figure to report (the compile report, the heal's and the domains')."""
    from llmaccel.eval.domains import ppl_of
    from llmaccel.heal.heal import held_out_quality
    m, src = load("preset:tiny-llama"), load("preset:tiny-llama")
    with torch.no_grad():
        dict(m.gm.named_parameters())["norm.weight"].mul_(1e5)   # logits of ~1e4
    ids = torch.randint(0, 512, (40,))
    res = evaluate(m, ids, ctx=16, baseline=src, progress=False)
    assert res["nll"] > 710 and res["ppl"] == math.inf and math.isfinite(res["baseline_ppl"])
    q = held_out_quality(m.gm, src.gm, ids[:32].view(2, 16), 2)
    assert q["ppl"] == math.inf and q["delta_ppl_pct"] == math.inf and math.isfinite(q["kl"])
    assert ppl_of(1.0) == pytest.approx(math.e)


def test_domain_texts_ship_inside_the_package():
    """The evaluation texts are package data (a wheel has no checkout around it)."""
    import tomllib
    from pathlib import Path

    import llmaccel
    from llmaccel.eval.domains import DATA_DIR, DOMAINS

    pkg = Path(llmaccel.__file__).resolve().parent
    assert DATA_DIR.resolve().parent == pkg
    globs = tomllib.loads((pkg.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["llmaccel"]
    for rel, _ in DOMAINS.values():
        path = DATA_DIR / rel
        assert path.is_file() and any(path.relative_to(pkg).match(g) for g in globs), rel


def test_mixed_calibration_takes_each_domain_in_turn_and_never_its_evaluation_part():
    from llmaccel.eval.text import CALIB_SPLITS, DATA_DIR, DOMAINS, mixed_tokens

    m = load("preset:tiny-llama")
    enc = lambda text: list(text.encode("utf-8"))  # noqa: E731 - a preset reads bytes
    ids = mixed_tokens(enc, 3 * 64 + 10, 64)
    assert ids.shape == (3 * 64 + 10,)
    got = [bytes(ids[i * 64:(i + 1) * 64].tolist()).decode("utf-8", "replace") for i in range(3)]
    for (name, split), window in zip(CALIB_SPLITS.items(), got):
        path = DATA_DIR / DOMAINS[name][0]
        assert split != DOMAINS[name][1]
        assert window[:20] in read_split(str(path), split)
        assert window[:40] not in read_split(str(path), DOMAINS[name][1])
    # through load_tokens, as compile's default calibration reads it
    from llmaccel.eval.text import load_tokens
    assert torch.equal(load_tokens(m, "mixed", "first-half", 200, ctx=64), mixed_tokens(enc, 200, 64))
