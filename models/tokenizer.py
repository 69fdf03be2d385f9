"""Byte-level BPE tokenizer of the embedded model, trained with ``tokenizers`` on the synthetic corpus.

Pre-tokenization follows Qwen2 / Qwen3 (digits split one by one, so numbers are copied digit by
digit; letters and punctuation apart), then byte-level mapping, so any UTF-8 text round-trips.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from models.chat import ADDED_TOKENS, CHAT_TEMPLATE, EOT, IM_END, SPECIAL_TOKENS

PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` entries (special and added tokens included).

    Returns a ``PreTrainedTokenizerFast`` with the chat template, ``<|im_end|>`` as EOS and
    ``<|endoftext|>`` as padding, ready for ``save_pretrained``.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(ADDED_TOKENS),
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=EOT,
                                   model_max_length=4096)
    fast.add_tokens(list(ADDED_TOKENS))
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t != EOT]})
    fast.chat_template = CHAT_TEMPLATE
    return fast
