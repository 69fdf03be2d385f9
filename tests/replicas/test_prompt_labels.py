"""Input-derived prompt labels (PASK prompt side) on rendered chat prompts."""

from replicas.prompt_labels import PROMPT_BUCKETS, label_text, prompt_labels

TOOL = {"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "Where to.", "enum": ["Paris", "Zürich"]},
        "seats": {"type": "integer", "enum": [1, 2]},
        "name": {"type": "string"}},
        "required": ["city"]}}}


def _spans(text, labels):
    """label name -> the text of each maximal run of that label."""
    runs, start = {}, 0
    for i in range(1, len(text) + 1):
        if i == len(text) or labels[i] != labels[start]:
            runs.setdefault(PROMPT_BUCKETS[labels[start]], []).append(text[start:i])
            start = i
    return runs


def test_labels_of_a_rendered_tool_prompt(engine):
    msgs = [{"role": "user", "content": "Book 2 seats to Zürich for \"Ann Lee\" please"}]
    text = engine.tokenizer.apply_chat_template(msgs, tools=[TOOL], add_generation_prompt=True, tokenize=False)
    runs = _spans(text, label_text(text))
    assert runs["tool_name"] == ["book_flight"]
    assert sorted(runs["param_key"]) == ["city", "city", "name", "seats"]   # properties + required
    assert sorted(runs["enum_member"]) == ["1", "2", "Paris", "Zürich"]
    assert sorted(runs["description"]) == ["Book a flight.", "Where to."]
    assert "2" in runs["user_value"] and "Zürich" in runs["user_value"] and '"Ann Lee"' in runs["user_value"]
    assert any("seats to" in r for r in runs["user_text"])
    assert "<|im_start|>assistant\n" in "".join(runs["chat_markup"])
    assert any("Function signatures" in r for r in runs["system_text"])


def test_token_labels_take_the_most_specific_char_label(engine):
    msgs = [{"role": "user", "content": "Fly to Zürich"}]
    ids = engine.tokenizer.apply_chat_template(msgs, tools=[TOOL], add_generation_prompt=True,
                                               return_dict=True)["input_ids"]
    labels = prompt_labels(engine.tokenizer, ids)
    assert len(labels) == len(ids)
    names = [PROMPT_BUCKETS[l] for l in labels]
    pieces = [engine.tokenizer.decode([t]) for t in ids]
    named = "".join(p for p, n in zip(pieces, names) if n == "tool_name")
    assert "book_flight" in named and len(named) <= len("book_flight") + 4
    assert names[0] == "chat_markup" and names[-1] == "chat_markup"
    assert "enum_member" in names and "user_value" in names
