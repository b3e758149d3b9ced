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
from llmaccel.runtime.sla_states import SlaStates

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
    gather = SlaStates.gather

    def counted(self, layer, rows):
        stacked.append(len(rows))
        return gather(self, layer, rows)
    monkeypatch.setattr(SlaStates, "gather", counted)
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
    """Two buffers per slot: a step reads the one holding its start and writes the other, so a
    step run again finds its start; the next step overwrites the older one."""
    s = SlaStates()
    state = lambda x: (torch.full((1, 2), float(x)),)   # noqa: E731  one state part, one row
    assert s.route(3, 0, 0) == (None, 0)          # position 0: the empty state, into buffer 0
    s.write(3, torch.tensor([0]), state(5), 0)
    s.commit(3, 0, 5)
    src, dst = s.route(3, 0, 5)
    assert (src, dst) == (0, 1)
    s.write(3, torch.tensor([dst]), state(9), dst)
    s.commit(3, dst, 9)
    assert s.route(3, 0, 5) == (0, 1)             # the step from 5 again: its start is still there
    assert s.route(3, 0, 9) == (1, 0)             # the next step overwrites the state after 5
    s.commit(3, 0, 10)
    with pytest.raises(LlmaccelError, match="after 5 tokens"):
        s.route(3, 0, 5)
    assert torch.equal(s.gather(3, torch.tensor([1]))[0], state(9)[0])
    s.write(3, torch.tensor([5]), state(1), 5)    # slot 2: the tensors grow, slot 0 kept
    assert s.store[3][0].shape[0] >= 6 and torch.equal(s.gather(3, torch.tensor([1]))[0], state(9)[0])
    assert s.route(3, 0, 0) == (None, 0)          # the slot reused by a new sequence
    with pytest.raises(LlmaccelError, match="after 10 tokens"):
        s.route(3, 0, 10)
    with pytest.raises(RuntimeError):
        s.copy_blocks([(0, 1)])
