"""Chat template rendering and tool-call parsing."""

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from models import bfcl, chat


def render(messages, tools=None, add_generation_prompt=True):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: __import__("json").dumps(x, ensure_ascii=False)
    return env.from_string(chat.CHAT_TEMPLATE).render(messages=messages, tools=tools,
                                                      add_generation_prompt=add_generation_prompt)


def test_template_renders_bfcl_tools_and_qwen3_markup():
    q = bfcl.load_questions("multiple")[0]
    tools = [bfcl.to_openai_tool(f) for f in q.functions]
    text = render(q.messages, tools)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert text.count('{"type": "function"') == len(tools)
    assert "<tools>" in text and "</tools>" in text
    assert text.endswith(f"<|im_start|>user\n{q.messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n")


def test_assistant_tool_calls_render_as_answer_format():
    calls = [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c} for c in calls]},
            {"role": "tool", "content": "42"}]
    text = render(msgs, add_generation_prompt=False)
    assert chat.render_answer(calls) + "<|im_end|>" in text
    assert "<tool_response>\n42\n</tool_response>" in text


def test_parse_round_trip_and_text():
    calls = [{"name": "a.b", "arguments": {"s": "x y", "n": [1, 2]}}]
    assert chat.parse_tool_calls(chat.render_answer(calls)) == (calls, "")
    assert chat.parse_tool_calls("no call here") == ([], "no call here")


@pytest.mark.parametrize("bad", ['<tool_call>\n{"name": 1}\n</tool_call>', "<tool_call>\n{oops\n</tool_call>",
                                 '<tool_call>\n{"name": "f", "arguments": {}}'])
def test_parse_rejects_malformed(bad):
    with pytest.raises(ValueError):
        chat.parse_tool_calls(bad)
