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
from llmaccel.ops.sla import state_bytes
from llmaccel.runtime.sla_states import SlaContext, SlaStates, prompt_groups, sla_specs

GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)
LENGTHS = (5, 40, 70, 1, 33)  # with a window of 8 and 2 sinks: tokens fold into the state often


FORMS, FORM_IDS = [{}, {"window": "8", "sinks": "2"}], ["slab", "window"]   # SLAB; window and sinks


def _case(window: dict, device: str = "cpu"):
    """A tiny sla model, prompts of LENGTHS and the reference executor's greedy tokens."""
    m = compile("preset:tiny-llama", ["sla"], {"sla": {"calib_samples": "2", "calib_seq_len": "32", **window}},
                eval_tokens=0, progress=False, device=device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]
    return m, prompts, [list(m.generate_ids(p, GREEDY)) for p in prompts]


@pytest.fixture(scope="module", params=FORMS, ids=FORM_IDS)
def case(request):
    return _case(request.param)


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
    grouped = []  # new prompts run in one padded call: how many at once
    prompts_call = SlaContext._prompts

    def counted_prompts(self, layer, group, *a):
        grouped.append(len(group))
        return prompts_call(self, layer, group, *a)
    monkeypatch.setattr(SlaContext, "_prompts", counted_prompts)
    llm = LLM(m, **kw)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    # the decode runner's groups: every running row at once, padded to its batch bucket
    assert max(stacked) == llm.core.runner.decode.bucket(kw.get("max_num_seqs", len(prompts)), 1)[0]
    met = llm.metrics()
    assert met["decode_steps"] > 0 and llm.core.runner.decode.launches > 0
    assert max(grouped) == (4 if not kw else 2)   # lengths 70, 40, 33, 5 together; 1 alone
    assert met["kv_blocks_used"] == 0 and met["prefix_caching"] is False
    assert met["kv_blocks_total"] == kw.get("max_num_seqs", met["kv_blocks_total"])
    assert met["sla_state_bytes"] == llm.core.cache.nbytes() > 0


def test_speculative_decoding_is_refused(case):
    with pytest.raises(LlmaccelError, match="linear attention"):
        LLM(case[0], speculative="ngram")


def _states(slots=4, fixed=False):
    """SlaStates of one layer whose state is one part of 2 values a row (S of one KV head of one
    dimension and z), no window."""
    spec = dict(layer=3, n_heads=1, n_kv_heads=1, head_dim=1, kernel_size=1, eps=1e-6)
    return SlaStates({3: spec}, slots=slots, max_len=64, dtype=torch.float32, device="cpu", fixed=fixed)


def state(x):
    return (torch.full((1, 1, 1, 1), float(x)), torch.full((1, 1, 1), float(x)), torch.zeros(1, 0, 1))


def test_a_step_run_again_starts_from_its_state():
    """Two buffers per slot: a step reads the one holding its start and writes the other, so a
    step run again finds its start; the next step overwrites the older one. Slot s's buffers
    are rows 2 (s + 1) and 2 (s + 1) + 1 (rows 0 and 1: the decode runner's scratch pair)."""
    s = _states()
    assert s.route(0, 0) == (None, 2)             # position 0: the empty state, into buffer 0
    s.write(3, torch.tensor([2]), state(5))
    s.commit(2, 5)
    src, dst = s.route(0, 5)
    assert (src, dst) == (2, 3)
    s.write(3, torch.tensor([dst]), state(9))
    s.commit(dst, 9)
    assert s.route(0, 5) == (2, 3)                # the step from 5 again: its start is still there
    assert s.route(0, 9) == (3, 2)                # the next step overwrites the state after 5
    s.commit(2, 10)
    with pytest.raises(LlmaccelError, match="after 5 tokens"):
        s.route(0, 5)
    assert torch.equal(s.gather(3, torch.tensor([3]))[0], state(9)[0])
    assert s.route(2, 0) == (None, 6)             # slot 2: the tensors grow, slot 0 kept
    assert s.store[3][0].shape[0] >= 8 and torch.equal(s.gather(3, torch.tensor([3]))[0], state(9)[0])
    assert s.route(0, 0) == (None, 2)             # the slot reused by a new sequence
    with pytest.raises(LlmaccelError, match="after 10 tokens"):
        s.route(0, 10)
    with pytest.raises(LlmaccelError, match="outside the 4 slots"):
        s.route(4, 0)
    with pytest.raises(RuntimeError):
        s.copy_blocks([(0, 1)])


@pytest.mark.parametrize("n", [1, 2, 5])
def test_a_decode_group_leaves_its_last_two_states_routable(n):
    """decode_row's parity puts the state after pos tokens in buffer (pos + parity) % 2, which is
    where a runner's sub-steps read and write it; after ran(), the host finds the state after the
    group and, for a group of one sub-step, the one before it (a group run again)."""
    s = _states(fixed=True)
    assert s.store[3][0].shape[0] == 2 * (4 + 1)   # every slot and the scratch pair, at once
    s.route(1, 0)
    s.commit(4, 7)                                 # slot 1: the state after 7 tokens in buffer 0
    entry = s.decode_row(1, 7)
    base, par = entry - entry % 2, entry % 2
    assert base == 4 and (7 + par) % 2 == 0
    s.ran(entry, 7, n)
    assert s.route(1, 7 + n)[0] == base + (7 + n + par) % 2
    assert s.route(1, 7 + n - 1)[0] == base + (7 + n - 1 + par) % 2
    if n > 1:
        with pytest.raises(LlmaccelError, match="after 7 tokens"):
            s.route(1, 7)
    assert s.decode_row(1, 7 + n) == entry         # the next group: the same parity
    s.ran(s.decode_row(2, 0), 0, 3)                # a one-token prompt decoded from position 0
    assert s.route(2, 3)[0] is not None


@pytest.mark.parametrize("where", ["relaunch", "collect"])
def test_a_decode_group_that_fails_is_computed_again(case, where):
    """A group that breaks off (after its sub-steps ran, or while its tokens are read) leaves
    rows' states past what the host applied: those rows are computed again from their tokens,
    and the output is still the reference's."""
    m, prompts, ref = case
    llm = LLM(m)
    real = getattr(llm.core.runner.decode, where)
    calls = []

    def flaky(*a):
        calls.append(1)
        if len(calls) == 2 and where == "collect":
            raise RuntimeError("broke off")
        out = real(*a)
        if len(calls) == 2:   # the group ran; the host never learns it did
            raise RuntimeError("broke off")
        return out
    setattr(llm.core.runner.decode, where, flaky)
    seqs = [llm.add_request(p, GREEDY) for p in prompts]
    with pytest.raises(RuntimeError, match="broke off"):
        while llm.has_unfinished():
            llm.step()
    while llm.has_unfinished():
        llm.step()
    assert [s.output_ids for s in seqs] == ref
    assert llm.core.sched.preemptions > 0


def test_all_slots_at_once_fit_the_memory_budget(case):
    """With CUDA graphs every slot's states are allocated at once: max_num_seqs is lowered (with a
    warning) to what the memory budget holds, and an engine whose budget holds none is refused."""
    from llmaccel.runtime.cache_backend import SlaBackend

    m = case[0]
    specs = sla_specs(m.gm)
    size = 2 * sum(state_bytes(sp["n_kv_heads"], sp["head_dim"], sp["kernel_size"], 4,
                               sp.get("window", 0), sp.get("sinks", 0)) for sp in specs.values())
    for budget, slots in ((10 ** 12, 256), (11 * size, 10)):   # 10 slots and the scratch pair
        if slots < 256:
            with pytest.warns(UserWarning, match="max_num_seqs lowered from 256 to 10"):
                assert SlaBackend._slots(specs, 256, torch.float32, budget) == slots
        else:
            assert SlaBackend._slots(specs, 256, torch.float32, budget) == slots
    with pytest.raises(LlmaccelError, match="no GPU memory left"):
        SlaBackend._slots(specs, 256, torch.float32, size)


def test_new_prompts_group_while_padding_stays_within_their_tokens():
    """Longest first; a prompt joins the group while the group padded to its longest computes at
    most twice its tokens."""
    assert prompt_groups({0: 5, 1: 40, 2: 70, 3: 1, 4: 33}) == [[2, 1, 4, 0], [3]]
    assert prompt_groups({7: 10, 8: 10, 9: 10}) == [[7, 8, 9]]
    assert prompt_groups({0: 100, 1: 10, 2: 10}) == [[0, 1], [2]]
    assert prompt_groups({}) == []


@pytest.mark.cuda
@pytest.mark.parametrize("window", FORMS, ids=FORM_IDS)
def test_cuda_graphs_match_reference_executor(window):
    """On the GPU (fp32: no greedy ties) the decode steps of an sla graph are captured as CUDA
    graphs over Inductor's code, the states written in place; tokens equal the reference
    executor's, with every decode shape captured and none run eagerly."""
    m, prompts, ref = _case(window, "cuda")
    for kw in ({}, {"max_num_batched_tokens": 24, "max_num_seqs": 2}):
        llm = LLM(m, **kw)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
        met = llm.metrics()
        assert met["graph_steps"] > 0 and met["graphs_captured"] > 0 and not met["graph_failures"]
