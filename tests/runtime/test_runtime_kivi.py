"""The paged runtime on graphs compiled with kvquant (packed KIVI cache) against the reference
executor's QuantizedKVCache: greedy tokens identical, the same packed bytes in the cache."""
import gc
from pathlib import Path

import pytest
import torch

from llmaccel import LLM, SamplingParams
from llmaccel.compiler.executor import forward, make_cache
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.ops.kvquant import bytes_per_token, quantized_len, unpack
from llmaccel.runtime.kivi_blocks import KiviBlockManager, stored_quantized
from llmaccel.runtime.kivi_cache import pool_sizes
from llmaccel.runtime.sequence import Sequence

GREEDY = SamplingParams(max_tokens=60, ignore_eos=True)
LENGTHS = (5, 40, 70, 100, 1, 33)  # with 60 new tokens: up to 160, the window of 32 crossed often


def _compile(bits: int):
    return compile("preset:tiny-llama", ["kvquant"], {"kvquant": {"bits": bits, "residual": 32}},
                   eval_tokens=0, progress=False)


@pytest.fixture(scope="module", params=[4, 2], ids=["kv4", "kv2"])
def case(request):
    m = _compile(request.param)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]
    return m, prompts, [list(m.generate_ids(p, GREEDY)) for p in prompts]


@pytest.mark.parametrize("kw", [
    {},
    {"kv_cache_tokens": 480},  # fp pool of 3-7 blocks: preemption and recompute
    {"max_num_batched_tokens": 48, "max_num_seqs": 3},  # group-aligned prefill chunks
], ids=["batched", "preempt", "chunked"])
def test_greedy_matches_reference_executor(case, kw):
    m, prompts, ref = case
    llm = LLM(m, **kw)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    met = llm.metrics()
    assert met["kv_blocks_used"] == 0 and met["prefix_caching"] is False
    assert met["block_size"] == llm.core.cache.group
    if "kv_cache_tokens" in kw:
        assert met["preemptions"] > 0


def test_cache_holds_the_reference_packed_bytes():
    """Mid-generation, the sequence's packed blocks and residual equal QuantizedKVCache's
    (prompt and generated tokens among them). Generated tokens' K/V differ from the executor's
    by float rounding (padded batched attention), so their codes may move by one step where a
    value sits at a rounding boundary."""
    m = _compile(4)
    prompt = list(range(3, 43))
    llm = LLM(m, kv_cache_tokens=1024)
    seq = llm.add_request(prompt, SamplingParams(max_tokens=70, ignore_eos=True))
    while seq.n_output < 61:
        llm.step()
    n = seq.num_computed  # tokens with KV in the cache
    ref = make_cache(m.gm, 1, 256, torch.float32)
    forward(m.gm, torch.tensor([prompt]), 0, ref)
    for i, t in enumerate(seq.output_ids[: n - len(prompt)]):
        forward(m.gm, torch.tensor([[t]]), len(prompt) + i, ref)
    c, g = llm.core.cache, llm.core.cache.group
    assert seq.kivi_nq * g == ref.layers[0].n_q == quantized_len(n, ref.specs[0]) > len(prompt)
    close = dict(rtol=1e-5, atol=1e-5)
    for layer, st in ref.layers.items():
        ids = torch.tensor(seq.block_table[: seq.kivi_nq])
        nq = st.n_q
        for mine, theirs in ((c.kp, st.kp), (c.vp, st.vp)):
            codes = unpack(mine[layer][ids].transpose(0, 1).flatten(1, 2), 4).int()
            diff = (codes - unpack(theirs[0, :, :nq], 4).int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01
        torch.testing.assert_close(c.ks[layer][ids].transpose(0, 1), st.ks[0, :, : nq // g], **close)
        torch.testing.assert_close(c.km[layer][ids].transpose(0, 1), st.km[0, :, : nq // g], **close)
        torch.testing.assert_close(c.vs[layer][ids].transpose(0, 1).flatten(1, 2), st.vs[0, :, :nq], **close)
        torch.testing.assert_close(c.vm[layer][ids].transpose(0, 1).flatten(1, 2), st.vm[0, :, :nq], **close)
        fp = torch.tensor(seq.block_table[seq.kivi_nq:])
        for pool, res in ((c.fk, st.kr), (c.fv, st.vr)):
            mine = pool[layer][fp].flatten(0, 1)[: n - nq].transpose(0, 1)
            torch.testing.assert_close(mine, res[0], **close)


def test_block_manager_ages_blocks_like_the_reference():
    """Prefill then decode one token at a time: packed count == the reference's, the fp part
    never above R/G + 1 blocks, and every block back in its free list at the end."""
    G, R = 16, 48
    bm = KiviBlockManager(num_fp=8, num_packed=20, group=G, residual=R)
    for n_prompt in (1, 50, 64, 130):
        seq = Sequence(list(range(n_prompt)), GREEDY, None, "cpu")
        for end in [n_prompt] + list(range(n_prompt + 1, n_prompt + 90)):
            assert bm.grow(seq, end)
            bm.release_aged(seq)
            seq.num_computed = end
            assert seq.kivi_nq * G == quantized_len(end, {"group": G, "residual": R})
            assert len(seq.block_table) - seq.kivi_nq <= R // G + 1
            seq.token_ids.append(0)
        bm.free_seq(seq)
        assert bm.num_free == bm.num_blocks
    # Chunked prefill: a chunk ending mid-prompt stores what the whole-prompt forward would.
    assert stored_quantized(64, 200, G, R) == 64 and stored_quantized(200, 200, G, R) == 144


def test_bytes_per_token_and_sizing():
    m = _compile(4)
    llm = LLM(m, kv_cache_tokens=4096)
    met = llm.metrics()
    want = sum(bytes_per_token(llm.core.cache.kv_quant_spec(i), 2, 16, scale_bytes=4) for i in range(2))
    assert met["kv_bytes_per_token"] == pytest.approx(want)
    assert met["kv_bytes_per_token"] < met["kv_bytes_per_token_fp"] / 3
    assert met["kv_cache_tokens"] == 4096 and met["kv_cache_bytes_per_token"] < met["kv_bytes_per_token_fp"]
    # From a byte budget the packed format holds several times the tokens of the fp cache.
    layers, budget = llm.core.cache.layers, 64 << 20
    nf, nq = pool_sizes(layers, llm.core.backend.spec, torch.float32, max_num_seqs=256, budget_bytes=budget)
    assert (nf + nq) * 32 > 4 * budget // met["kv_bytes_per_token_fp"]


def test_clear_refusals():
    m = _compile(4)
    with pytest.raises(LlmaccelError, match="speculative decoding does not run on a KIVI"):
        LLM(m, speculative="ngram")
    with pytest.raises(LlmaccelError, match="kv_cache_tokens >= 96"):
        LLM(m, kv_cache_tokens=64)
    with pytest.raises(LlmaccelError, match="at least the KIVI group"):
        LLM(m, max_num_batched_tokens=16)
    out = LLM(m, kv_cache_tokens=128).generate([[5] * 400, [7] * 10], SamplingParams(max_tokens=4))
    assert out[0].finish_reason == "error" and "KV cache holds" in out[0].error
    assert len(out[1].token_ids) == 4


@pytest.mark.real
def test_real_smollm2_kv4_matches_executor():
    """SmolLM2-135M, kvquant bits=4 (group 32, residual 128): 3 prompts of 30-200 tokens, 40
    greedy tokens each, batched, identical to the reference executor (whose one-token-at-a-time
    generation takes most of this test's time)."""
    m = compile("smollm2-135m", ["kvquant"], {"kvquant": {"bits": 4}}, eval_tokens=0, progress=False)
    with open(Path(__file__).resolve().parents[2] / "llmaccel" / "data" / "wikitext2" / "wiki.test.raw") as f:
        ids = m.encode(f.read(20000))
    prompts = [ids[a: a + n] for a, n in ((0, 30), (400, 170), (700, 200))]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [list(m.generate_ids(p, params)) for p in prompts]
    llm = LLM(m, kv_cache_tokens=4096)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.metrics()["kv_packed_blocks_total"] > 0


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [4, 2])
def test_cuda_runtime_matches_executor(bits):
    """On the GPU (fp32, so that greedy ties are not an issue): Triton quantize and paged KIVI
    decode kernels in the loop, preemption included."""
    m = compile("preset:tiny-llama", ["kvquant"], {"kvquant": {"bits": bits, "residual": 32}},
                eval_tokens=0, progress=False, dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]
    ref = [list(m.generate_ids(p, GREEDY)) for p in prompts]
    for kw in ({}, {"kv_cache_tokens": 480}):
        llm = LLM(m, **kw)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
        del llm  # the default sizing takes most of the GPU: free it for the next engine
        gc.collect()
        torch.cuda.empty_cache()
