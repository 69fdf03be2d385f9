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


def test_closing_tag_inside_a_string_argument_stays_in_it():
    """The grammar lets a string argument hold "</tool_call>"; the parser stopped at it and the
    server returned no call."""
    calls = [{"name": "save", "arguments": {"text": "a</tool_call>b <tool_call> c", "n": 1}},
             {"name": "g", "arguments": {}}]
    assert chat.parse_tool_calls("Sure.\n" + chat.render_answer(calls)) == (calls, "Sure.")


def _stream(text):
    """The parser's states over every prefix of ``text`` (the last one final)."""
    parser = chat.ToolCallParser()
    return [parser.update(text[:n], final=n == len(text)) for n in range(len(text) + 1)]


def test_streamed_states_grow_into_the_whole_answer():
    """While a call is written its arguments text only grows, always a prefix of the final
    arguments, and content only grows too: what a stream sent is never taken back."""
    text = ('hi <tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call>y", "b": {"c": [1, 2]}}}\n</tool_call>'
            '\n<tool_call>\n{"name": "g", "arguments": {"s": "\\"}\\"", "t":  true}}\n</tool_call> bye')
    states = _stream(text)
    final = states[-1]
    assert [(c.name, c.arguments) for c in final.calls] == [
        ("f", '{"a": "x</tool_call>y", "b": {"c": [1, 2]}}'), ("g", '{"s": "\\"}\\"", "t":  true}')]
    assert [c.value for c in final.calls] == [{"a": "x</tool_call>y", "b": {"c": [1, 2]}}, {"s": '"}"', "t": True}]
    assert final.content == "hi \n bye" and not final.errors
    for before, after in zip(states, states[1:]):
        assert after.content.startswith(before.content)
        for i, c in enumerate(before.calls):
            if c.name is not None:
                assert after.calls[i].name == c.name and after.calls[i].arguments.startswith(c.arguments)
    # The name is known before the arguments end, and the arguments arrive in pieces.
    first_named = next(n for n, s in enumerate(states) if s.calls and s.calls[0].name == "f")
    assert first_named < text.index('"x<') and len({s.calls[0].arguments for s in states if s.calls}) > 10
    assert not any("<" in s.content for s in states)   # a tag's start is held back, never sent


def test_cut_and_malformed_blocks_and_stray_tags_are_not_content():
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call>'
    state = chat.ToolCallParser().update("ok " + cut, final=True)
    assert state.content == "ok " and state.calls == [] and "cut short" in state.errors[0]
    state = chat.ToolCallParser().update('a</tool_call>b<tool_call>\n{oops}\n</tool_call>c', final=True)
    assert state.content == "abc" and state.calls == [] and "not valid JSON" in state.errors[0]
    # A stop string or stop token at </tool_call>: the whole JSON is a call, unless asked otherwise.
    whole = '<tool_call>\n{"name": "f", "arguments": {}}\n'
    assert [c.name for c in chat.ToolCallParser().update(whole, final=True).calls] == ["f"]
    assert chat.ToolCallParser(unclosed_ok=False).update(whole, final=True).errors == ["unterminated <tool_call> block"]
