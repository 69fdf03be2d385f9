"""Incremental detokenization: the text of a growing output, each token decoded once.

Decoding the whole output on every step costs O(n) per token, and it is wrong for streaming: a
character split across tokens (byte-level BPE splits "é" into two) decodes as U+FFFD until its
last byte arrives, so a client that was sent the U+FFFD never gets the character. Text is only
released once its characters are whole: it only grows, and each value is a prefix of the next.

Two ways, the same text:

- byte-level BPE vocabularies (Qwen, Llama 3, GPT-2; :func:`token_bytes_of` says whether one is):
  each token's bytes are looked up (built once per id) and fed to an incremental UTF-8 decoder,
  which holds back an incomplete last character: each token is decoded once, and the final text
  is the one ``decode`` gives (tokenizers' ByteLevel decoder joins the tokens' bytes and decodes
  them with U+FFFD for invalid bytes, the same rule as Python's ``errors="replace"``).
- any other tokenizer: the newest ids are decoded with the previous step's ids as context, text
  taken once it no longer ends in U+FFFD (vLLM's ``detokenize_incrementally``, Hugging Face's
  ``TextStreamer``): two ``decode`` calls a token, each token going through three of them, and a
  whole decode at :meth:`IncrementalDetokenizer.flush`.
"""

from __future__ import annotations

import codecs
from typing import Callable


class TokenBytes(dict):
    """Token id -> its bytes in the output text (``b""`` for special tokens, which
    ``skip_special_tokens`` drops, and for ids outside the vocabulary), built once per id from a
    byte-level tokenizer's own tables, by the rule of tokenizers' ByteLevel decoder: a token whose
    every character is a byte symbol is those bytes, any other (an added token such as
    ``<tool_call>`` with a space or non-byte character) is its UTF-8."""

    def __init__(self, backend, byte_of: dict[str, int]):
        super().__init__()
        self._backend, self._byte_of = backend, byte_of
        self._special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}

    def __missing__(self, token: int) -> bytes:
        piece = None if token in self._special else self._backend.id_to_token(token)
        if piece is None:
            out = b""
        else:
            symbols = [self._byte_of.get(c) for c in piece]
            out = piece.encode() if None in symbols else bytes(symbols)
        self[token] = out
        return out


def token_bytes_of(tokenizer) -> TokenBytes | None:
    """A :class:`TokenBytes` for a Hugging Face fast tokenizer whose decoder is tokenizers'
    ByteLevel alone and whose ``decode`` adds no clean-up; None for any other (then decode)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if type(backend.decoder).__name__ != "ByteLevel":
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return TokenBytes(backend, {c: b for b, c in bytes_to_unicode().items()})


class IncrementalDetokenizer:
    """Args:
        decode: ``ids -> str`` (special tokens skipped), the tokenizer's own decode (the fallback).
        token_bytes: ``id -> bytes`` (a :class:`TokenBytes`); when given, ``decode`` is not used.

    ``text`` is what was released so far; :meth:`add` returns what one token released.
    """

    def __init__(self, decode: Callable[[list[int]], str] | None = None, token_bytes: TokenBytes | None = None):
        if decode is None and token_bytes is None:
            raise ValueError("IncrementalDetokenizer needs decode or token_bytes")
        self._decode, self._bytes = decode, token_bytes
        # The bytes of an incomplete last character (what ``codecs``' incremental UTF-8 decoder
        # buffers; the same rule, one call a token instead of two).
        self._pending = b"" if token_bytes is not None else None
        self._ids: list[int] = []
        self._prefix = 0   # ids[prefix:read] were decoded last time: context for the next tail
        self._read = 0     # ids before this one are in ``text``
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one id; returns the text it completed (may be empty, or hold earlier held-back
        bytes too)."""
        if self._pending is not None:
            data = self._pending + self._bytes[token_id]
            delta, used = codecs.utf_8_decode(data, "replace", False)
            self._pending = data[used:]
            self.text += delta
            return delta
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
        the ``text`` before is a prefix of it."""
        if self._pending is not None:
            self.text += codecs.utf_8_decode(self._pending, "replace", True)[0]
            self._pending = b""
        else:
            self.text = self._decode(self._ids)
        return self.text
