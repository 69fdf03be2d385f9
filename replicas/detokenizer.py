"""Incremental detokenization: the text of a growing output, decoding only its tail each step.

Decoding the whole output on every step costs O(n) per token, and it is wrong for streaming: a
character split across tokens (byte-level BPE splits "é" into two) decodes as U+FFFD until its
last byte arrives, so a client that was sent the U+FFFD never gets the character. Here the newest
ids are decoded together with the ids of the previous step as context, and text is only taken
once it no longer ends in U+FFFD: the text only grows, and each value is a prefix of the next
(the scheme of vLLM's ``detokenize_incrementally`` and Hugging Face's ``TextStreamer``).
"""

from __future__ import annotations

from typing import Callable


class IncrementalDetokenizer:
    """Args:
        decode: ``ids -> str`` (special tokens skipped), the tokenizer's own decode.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0   # ids[prefix:read] were decoded last time: context for the next tail
        self._read = 0     # ids before this one are in ``text``
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one id; returns the text it completed (may be empty, or hold earlier held-back
        bytes too)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""      # nothing new, or an incomplete character: wait for more bytes
        delta = after[len(before):]
        self.text += delta
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def flush(self) -> str:
        """The full decode of every id added (an incomplete last character included, as U+FFFD);
        ``text`` is a prefix of it."""
        self.text = self._decode(self._ids)
        return self.text
