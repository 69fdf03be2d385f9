"""Jump-forward decoding: the tokens a grammar forces, without a decode step each.

Where the grammar allows only one continuation text (the ``<tool_call>\\n{"name": "`` scaffold, a
key after ``{``, the rest of an enum value once its prefix is unique), the matcher's
``find_jump_forward_string`` gives it. The engine drafts its tokens and feeds them to the model as
one short chunk with the next step (``LLMEngine._forward``), instead of one decode step per token
(SGLang's jump-forward; vLLM does not do it), then keeps the draft tokens the model samples itself
at each position and takes back the rest (``LLMEngine._verify_draft``: speculative verification
with the grammar as the draft model), so outputs are the model's own.

Retokenization. The model would have spelled the forced text with tokens of its own choosing; the
draft is the tokenizer's canonical tokenization of it *in context*, which is what a model trained
on tokenized text (ours: the synthetic task) mostly produces (a spelling it does not produce is
rejected by the verification: a wasted row, not a changed output), with two guards at the boundaries:

- left: no sampled token is rolled back (SGLang retokenizes the last sampled token with the
  forced text, which can change a token the model already chose). The last few sampled tokens'
  text is tokenized together with the forced text, and if the canonical tokenization starts
  with exactly those tokens, the forced tokens are the rest (so a forced text that starts in the
  middle of a word is split as the whole word would be); else the forced text is tokenized alone;
- right: the tokens reaching into the forced text's last pre-tokenizer piece are held back: what
  follows can change how that piece splits (``": {`` alone is ``'":' ' ' '{'``, but before
  ``"city"`` it is ``'":' ' {"' 'city'``), so the model samples them itself. Pieces before the
  last one are split the same whatever follows (the pre-tokenizer's regex matches left to right).

Every draft token is accepted by the matcher first; the first one it refuses ends the draft.
Outputs with and without jump-forward are compared, not assumed equal (``python -m
bench.jump_forward``: identical outputs and accuracy per category, drafted and kept tokens).
"""

from __future__ import annotations

from typing import Callable


class ForcedTokenizer:
    """The tokens to append for a forced text after a sequence's sampled tokens (see the module
    docstring). ``tokenizer``: a Hugging Face tokenizer (fast: offsets and pre-tokenizer; a slow
    one holds back only the last token); ``token_text``: token id -> its text with special tokens
    spelled out; ``stop_ids``: tokens never appended (a run ends before one); ``context``: how
    many sampled tokens are retokenized with the forced text."""

    def __init__(self, tokenizer, token_text, stop_ids=(), context: int = 8):
        self.tokenizer, self.token_text, self.stop_ids, self.context = tokenizer, token_text, set(stop_ids), context
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.pre_tokenizer = backend.pre_tokenizer if backend is not None else None

    def __call__(self, sampled: list[int], text: str) -> list[int]:
        """Canonical tokens of ``text`` following the token ids ``sampled``, held back at the right."""
        tail = list(sampled[-self.context:])
        head = "".join(self.token_text[t] for t in tail)
        ids, offsets = self._encode(head + text)
        if ids[:len(tail)] != tail:        # the model's tokens are not canonical here: text alone
            tail, head = [], ""
            ids, offsets = self._encode(text)
        full = head + text
        if self.pre_tokenizer is not None and offsets is not None:
            pieces = self.pre_tokenizer.pre_tokenize_str(full)
            cut = max(len(head), pieces[-1][1][0]) if pieces else len(full)
            keep = [t for t, (_, e) in zip(ids[len(tail):], offsets[len(tail):]) if e <= cut]
        else:
            keep = ids[len(tail):-1]
        out = []
        for t in keep:
            if t in self.stop_ids:
                break
            out.append(t)
        return out

    def _encode(self, text: str):
        if getattr(self.tokenizer, "is_fast", False):
            enc = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
            return enc["input_ids"], enc["offset_mapping"]
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"], None


def forced_tokens(matcher, encode: Callable[[str], list[int]], max_tokens: int) -> list[int]:
    """Advance ``matcher`` over the tokens its grammar forces next and return them.

    Args:
        matcher: a :class:`replicas.grammar.Matcher` (either backend), in the state after the last
            sampled token; on return it has accepted the returned tokens (the engine rolls it
            back: the draft is accepted again as it is verified).
        encode: forced text -> the tokens to append for it (a :class:`ForcedTokenizer` bound to the
            sequence's sampled tokens).
        max_tokens: at most this many tokens (``<= 0``: none).

    Returns:
        ``encode``'s tokens for the forced string, cut at the first one the matcher refuses and at
        ``max_tokens``; ``[]`` when nothing is forced.
    """
    if max_tokens <= 0 or matcher.is_terminated():
        return []
    text = matcher.find_jump_forward_string()
    if not text:
        return []
    out: list[int] = []
    for token in encode(text)[:max_tokens]:
        if not matcher.accept_token(token):
            break
        out.append(token)
    return out
