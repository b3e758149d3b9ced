"""LLM on graphs compiled with sla (linear attention, without and with a window and sinks): a
recurrent state per sequence in a slot of its own (runtime/sla_states.py) against the reference
executor's LinearAttentionCache: greedy tokens identical under continuous batching and chunked
prefill, the decode rows' states stepped together; a step run again starts from the state it
started from."""
import pytest
import torch

from llmaccel import LLM, SamplingParams
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.runtime.sla_states import SlaContext, SlaStates

GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)
LENGTHS = (5, 40, 70, 1, 33)  # with a window of 8 and 2 sinks: tokens fold into the state often


@pytest.fixture(scope="module", params=[{}, {"window": "8", "sinks": "2"}], ids=["slab", "window"])
def case(request):
    m = compile("preset:tiny-llama", ["sla"], {"sla": {"calib_samples": "2", "calib_seq_len": "32",
                                                       **request.param}}, eval_tokens=0, progress=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]
    return m, prompts, [list(m.generate_ids(p, GREEDY)) for p in prompts]


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 24, "max_num_seqs": 2},  # prefill in chunks, requests wait for a slot
], ids=["batched", "chunked"])
def test_greedy_matches_reference_executor(case, kw, monkeypatch):
    m, prompts, ref = case
    stacked = []  # decode rows stepped together: how many at once
    step = SlaContext._step_together

    def counted(self, layer, rows, *a):
        stacked.append(len(rows))
        return step(self, layer, rows, *a)
    monkeypatch.setattr(SlaContext, "_step_together", counted)
    llm = LLM(m, **kw)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert max(stacked) == kw.get("max_num_seqs", len(prompts))
    met = llm.metrics()
    assert met["kv_blocks_used"] == 0 and met["prefix_caching"] is False
    assert met["kv_blocks_total"] == kw.get("max_num_seqs", met["kv_blocks_total"])
    assert met["sla_state_bytes"] == llm.cache.nbytes() > 0


def test_speculative_decoding_is_refused(case):
    with pytest.raises(LlmaccelError, match="linear attention"):
        LLM(case[0], speculative="ngram")


def test_a_step_run_again_starts_from_its_state():
    s = SlaStates()
    a, b, c = (torch.zeros(1),), (torch.ones(1),), (torch.full((1,), 2.0),)
    assert s.get(0, 3, 0) is None          # position 0: the empty state, whatever the slot held
    s.put(0, 3, 0, 5, a)
    s.put(0, 3, 5, 9, b)
    assert s.get(0, 3, 5) is a and s.get(0, 3, 9) is b
    s.put(0, 3, 5, 9, c)                   # the step from 5 ran again: its new result replaces b
    assert s.get(0, 3, 5) is a and s.get(0, 3, 9) is c
    s.put(0, 3, 9, 10, b)                  # the next step: the state before 5 is dropped
    with pytest.raises(LlmaccelError, match="after 5 tokens"):
        s.get(0, 3, 5)
    s.put(0, 3, 0, 4, c)                   # the slot reused by a new sequence
    assert s.get(0, 3, 4) is c and s.get(1, 3, 0) is None
    with pytest.raises(RuntimeError):
        s.copy_blocks([(0, 1)])
