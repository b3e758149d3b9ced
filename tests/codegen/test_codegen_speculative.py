"""Greedy speculative decoding on the static decode path equals plain greedy decoding."""
import dataclasses

import pytest
import torch

from llmaccel.bench.run import bench
from llmaccel.codegen.engine import DecodeEngine
from llmaccel.codegen.speculative import SpeculativeDecoder, parse_draft
from llmaccel.compiler.model import Model, load
from llmaccel.errors import LlmaccelError
from llmaccel.runtime.graph import layerskip_draft


def _engines(n_draft_layers: int | None):
    m = load("preset:tiny-llama")
    eng = DecodeEngine(m, 1, 96, compile=False)
    if n_draft_layers is None:
        return eng, "ngram"
    dgm = layerskip_draft(m.gm, m.config, n_draft_layers)
    dcfg = dataclasses.replace(m.config, n_layers=n_draft_layers)
    d = DecodeEngine(Model(dgm, dcfg, source="draft"), 1, 96, compile=False, cache=eng.cache)
    return eng, d


@pytest.mark.parametrize("layers,k", [(None, 3), (1, 4), (1, 1)])
def test_speculative_equals_plain_greedy(layers, k):
    eng, draft = _engines(layers)
    g = torch.Generator().manual_seed(3)
    for P in (5, 17):
        ids = torch.randint(0, eng.model.config.vocab_size, (1, P), generator=g)
        plain = eng.generate(ids, 40)
        dec = SpeculativeDecoder(eng, draft, k)
        assert torch.equal(dec.generate(ids, 40), plain)
        st = dec.stats()
        assert 1 <= st["spec_tokens_per_round"] <= k + 1 and st["spec_rounds"] <= 40


def test_speculative_bad_input():
    eng, _ = _engines(None)
    with pytest.raises(LlmaccelError, match="speculative draft"):
        parse_draft("self:99", eng.model.config.n_layers)
    with pytest.raises(LlmaccelError, match="exceed"):
        SpeculativeDecoder(eng, "ngram", 4).generate(torch.zeros(1, 90, dtype=torch.long), 8)
    with pytest.raises(LlmaccelError, match="batch 1"):
        bench("preset:tiny-llama", batch=2, gen_len=4, speculative="ngram", measure_bw=False)


def test_bench_reports_speculative():
    res = bench("preset:tiny-llama", prompt_len=8, gen_len=24, speculative="self:1,ngram", spec_k=3,
                measure_bw=False, warmup=1)
    assert [r["speculative"] for r in res["speculative"]] == ["self:1", "ngram"]
    for r in res["speculative"]:
        assert r["spec_identical_to_plain"] and r["spec_decode_tok_s"] > 0
        assert 0 <= r["spec_accept_rate"] <= 1
