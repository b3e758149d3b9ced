"""The engine under memory pressure: a KV cache far smaller than the load. Requests are
preempted and recomputed, none is lost, each ends with exactly its length and the same tokens
as with room to spare; a request that can never fit fails alone in one line."""
import pytest
import torch

from llmaccel import LLM, SamplingParams
from llmaccel.errors import LlmaccelError

CACHE, BLOCK = 96, 8  # 12 blocks


def _load(n: int, seed: int = 0):
    """n prompts of 8..40 tokens, each asking for 24 tokens: up to 64 tokens a request, 2/3 of
    the cache; greedy and seeded sampling mixed."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 500, (int(k),), generator=g).tolist()
               for k in torch.randint(8, 41, (n,), generator=g)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
              for i in range(n)]
    return prompts, params


def test_64_requests_on_a_cache_far_below_the_load_all_finish_exactly(tiny):
    prompts, params = _load(64)
    need = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    assert need >= 30 * CACHE  # the load is 30x the cache (each request 1/6..2/3 of it)
    roomy = [o.token_ids for o in LLM(tiny, kv_cache_tokens=8192).generate(prompts, params)]
    llm = LLM(tiny, kv_cache_tokens=CACHE, block_size=BLOCK)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == roomy  # nothing lost, nothing changed by recompute
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    m = llm.metrics()
    assert m["preemptions"] > 0 and m["kv_blocks_used"] == 0 and llm.core.bm.num_free == CACHE // BLOCK
    assert not llm.has_unfinished()


def test_a_prompt_larger_than_the_cache_fails_alone(tiny):
    prompts, params = _load(12, seed=1)
    big = list(range(3, 3 + CACHE + 10))
    llm = LLM(tiny, kv_cache_tokens=CACHE, block_size=BLOCK)
    outs = llm.generate(prompts[:6] + [big] + prompts[6:], params[:6] + [GREEDY_24] + params[6:])
    bad = outs[6]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error == f"the prompt has {len(big)} tokens; the whole KV cache holds {CACHE}"
    rest = outs[:6] + outs[7:]
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in rest)
    assert llm.metrics()["kv_blocks_used"] == 0 and llm.metrics()["requests_failed"] == 1
    with pytest.raises(LlmaccelError, match="whole KV cache holds 96"):
        list(llm.stream(big, GREEDY_24))


def test_a_request_that_outgrows_the_cache_stops_at_its_edge(tiny):
    """A prompt that fits, with more new tokens than the cache holds after it: it ends with
    finish_reason 'length' when it fills the whole cache, the others are unaffected."""
    prompts, params = _load(8, seed=2)
    grow = list(range(3, 83))  # 80 tokens, 16 places left
    llm = LLM(tiny, kv_cache_tokens=CACHE, block_size=BLOCK)
    outs = llm.generate([grow] + prompts, [SamplingParams(max_tokens=64, ignore_eos=True)] + params)
    assert outs[0].finish_reason == "length" and len(grow) + len(outs[0].token_ids) == CACHE + 1
    assert all(len(o.token_ids) == 24 for o in outs[1:])
    assert llm.metrics()["kv_blocks_used"] == 0


GREEDY_24 = SamplingParams(max_tokens=24, ignore_eos=True)
