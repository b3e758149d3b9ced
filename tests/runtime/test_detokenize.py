"""Incremental detokenization against decoding everything at once, and stop strings."""
from llmaccel.runtime.detokenize import IncrementalDetokenizer, find_stop


class ByteTokenizer:
    """One token per UTF-8 byte: a character of several bytes spans several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class SpaceTokenizer:
    """Word tokens whose decode drops the leading space of the first one (as SentencePiece
    decoders do), so a window's text depends on where it starts."""
    words = ["Hello", " world", ",", " naïve", " café", " ok"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words[i] for i in ids).lstrip(" ")


def _grow(tok, ids):
    d = IncrementalDetokenizer(tok)
    pieces = [d.update(ids[:n]) for n in range(1, len(ids) + 1)]
    return d, pieces


def test_incremental_text_equals_the_whole_decode():
    text = "Grüße, 世界! ok"
    ids = list(text.encode())
    d, pieces = _grow(ByteTokenizer(), ids)
    assert d.text == text and "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    ids = [0, 1, 2, 3, 4, 5]
    d, _ = _grow(SpaceTokenizer(), ids)
    assert d.text == SpaceTokenizer().decode(ids)


def test_find_stop_looks_at_the_new_tail_only():
    assert find_stop("abc def.", [".", "xyz"], 5) == 7
    assert find_stop(".bc def", ["."], 4) == -1  # the "." is in old text, checked before
    assert find_stop("say STOP", ["STOP"], 1) == 4  # a stop string ending in the new character
