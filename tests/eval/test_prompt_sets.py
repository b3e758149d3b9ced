"""The prompt sets for measuring speculative decoding (eval/prompts.py)."""
from llmaccel.eval.prompts import _GROUNDED_PARTS, GROUNDED, OPEN


def test_sets_have_20_distinct_prompts_each():
    for s in (GROUNDED, OPEN):
        assert len(set(s)) == len(s) >= 20 and all(isinstance(p, str) and p.strip() for p in s)
    assert not set(GROUNDED) & set(OPEN)


def test_grounded_prompts_carry_a_passage_to_copy():
    # 150-400 characters: enough for n-gram lookup to find runs, short enough for a tiny preset
    # read as bytes (512 positions) to hold prompt and answer
    assert all(150 <= len(text) <= 400 for _, text in _GROUNDED_PARTS)
    assert all(text in p for (_, text), p in zip(_GROUNDED_PARTS, GROUNDED))
    assert len({text for _, text in _GROUNDED_PARTS}) == len(GROUNDED)
