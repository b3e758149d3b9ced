"""Incremental detokenization: the text of a growing list of token ids, decoding a short window
of the last tokens per call instead of the whole output (quadratic over a long generation).

The window starts a few tokens before the new ones (`prefix`), and the new text is what the
window's decode adds past the decode of its old part, so tokenizers whose decode depends on the
neighbouring tokens (leading spaces, multi-byte characters split across tokens) give the text
that decoding everything at once gives. Text ending in an incomplete character (U+FFFD) waits
for the next token.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix = 0  # window start
        self.read = 0    # tokens whose text is in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        """ids: every output token so far (a longer list each call); returns the new text."""
        if len(ids) <= self.read:
            return ""
        old = self._decode(ids[self.prefix:self.read])
        new = self._decode(ids[self.prefix:])
        if len(new) <= len(old) or new.endswith("\ufffd"):
            return ""
        delta = new[len(old):]
        self.text += delta
        self.prefix, self.read = self.read, len(ids)
        return delta


def find_stop(text: str, stops: list[str], new: int) -> int:
    """Where the earliest stop string begins in text, looking only where one could end in its
    last `new` characters; -1 if none."""
    longest = max(map(len, stops))
    start = max(0, len(text) - new - longest + 1)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits, default=-1)


def detok_of(seq, tokenizer) -> IncrementalDetokenizer:
    """The sequence's incremental detokenizer, made on first use."""
    if seq.detok is None:
        seq.detok = IncrementalDetokenizer(tokenizer)
    return seq.detok
