"""Prompt lookup (ngram) and the speculative back-off: the incremental n-gram index against a
scan of the whole history, the pause lengths, and plain decode steps for rows without a match."""
import random
from types import SimpleNamespace

from llmaccel import LLM, SamplingParams
from llmaccel.runtime.block_manager import BlockManager
from llmaccel.runtime.eager_steps import MAX_PAUSE, EagerSteps
from llmaccel.runtime.scheduler import Scheduler
from llmaccel.runtime.sequence import Sequence
from llmaccel.runtime.speculative import NgramIndex
from tests.runtime.conftest import GREEDY


def _scan(toks, k, n_max=3, n_min=1):
    """The lookup as a scan: the latest earlier occurrence of the longest suffix that occurred."""
    L = len(toks)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for s in range(L - n - 1, -1, -1):
            if toks[s: s + n] == toks[L - n:]:
                return toks[s + n: s + n + k]
    return []


def test_the_index_finds_what_a_scan_of_the_history_finds():
    rng = random.Random(3)
    for trial in range(40):
        vocab = rng.choice([2, 3, 5, 50])
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
        idx = NgramIndex(3, 1)
        for _ in range(60):   # the list grows as a sequence does, by one or several tokens
            k = rng.randrange(1, 6)
            assert idx.lookup(toks, k) == _scan(toks, k), (trial, toks, k)
            toks += [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5]))]


def test_misses_at_one_token_pause_proposals_doubling_and_a_hit_resets():
    core = SimpleNamespace(stats={"spec_proposed": 0, "spec_accepted": 0, "spec_verifies": 0,
                                  "spec_emitted": 0}, k_max=4)
    steps = SimpleNamespace(stats=core.stats, core=core)
    seq = SimpleNamespace(spec_k=2, spec_pause=0, spec_misses=0)
    EagerSteps._spec_stats(steps, seq, 2, 0)      # a miss at two tokens only shortens k
    assert (seq.spec_k, seq.spec_pause) == (1, 0)
    pauses = []
    for _ in range(9):
        EagerSteps._spec_stats(steps, seq, 1, 0)
        pauses.append(seq.spec_pause)
    assert pauses == [1, 2, 4, 8, 16, 32, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE] and seq.spec_k == 1
    EagerSteps._spec_stats(steps, seq, 1, 1)      # accepted: k grows, the next miss pauses 1
    assert (seq.spec_k, seq.spec_misses) == (2, 0)
    EagerSteps._spec_stats(steps, seq, 2, 0)
    EagerSteps._spec_stats(steps, seq, 1, 0)
    assert seq.spec_pause == 1
    assert core.stats["spec_verifies"] == 13 and core.stats["spec_accepted"] == 1


def test_a_paused_sequence_is_scheduled_as_a_plain_decode_row():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=10), None, "cpu", spec_k=3)
    seq.spec_pause = 2
    sched.add(seq)
    assert sched.schedule()[0] == [(seq, 3)]          # the prompt
    seq.num_computed, seq.token_ids = 3, [1, 2, 3, 4]
    got = []
    for _ in range(3):
        (s, q), = sched.schedule()[0]
        got.append(q)
        seq.num_computed, seq.token_ids = len(seq.token_ids), seq.token_ids + [5]
    assert got == [1, 1, 4]                           # two plain steps, then 1 + k


def test_ngram_rows_without_a_match_run_the_decode_runner(tiny, prompts, reference):
    """Greedy output equals the reference executor's; every eager step is a prefill or has a
    proposal: steps where no row found a match ran on the decode runner."""
    llm = LLM(tiny, speculative="ngram")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    m = llm.metrics()
    assert m["decode_steps"] > 0
    assert m["eager_steps"] <= m["spec_verifies"] + 2   # the prompts fill one or two steps
