"""Loading BFCL data and converting its schema dialect."""

import pytest

from models import bfcl


def test_load_questions_and_ground_truth():
    qs = bfcl.load_questions("parallel")
    assert len(qs) == 200
    assert all(q.ground_truth for q in qs)
    assert bfcl.load_questions("irrelevance")[0].ground_truth is None


def test_to_json_schema_dialect():
    node = {"type": "dict", "properties": {
        "x": {"type": "float", "description": "d"}, "t": {"type": "tuple", "items": {"type": "integer"}},
        "a": {"type": "any"}, "m": {"type": "HashMap"}, "s": {"type": "String"}}, "required": ["x", "zz"]}
    out = bfcl.to_json_schema(node)
    assert out["type"] == "object" and out["required"] == ["x"]
    props = out["properties"]
    assert props["x"] == {"type": "number", "description": "d"}
    assert props["t"] == {"type": "array", "items": {"type": "integer"}}
    assert props["a"]["type"] == "string" and props["m"]["type"] == "object" and props["s"]["type"] == "string"


def test_every_bfcl_function_converts():
    fns = bfcl.load_functions()
    assert len(fns) > 1000
    for fn in fns:
        tool = bfcl.to_openai_tool(fn)
        assert tool["function"]["parameters"]["type"] == "object"


def test_unknown_category_and_corrupt_line(tmp_path):
    with pytest.raises(bfcl.BFCLDataError, match="unknown BFCL category"):
        bfcl.load_questions("live_simple")
    (tmp_path / "BFCL_v4_multiple.json").write_text('{"id": "multiple_0", "question": [[]], "function": []}\n{not json\n')
    with pytest.raises(bfcl.BFCLDataError, match=r"BFCL_v4_multiple.json:2: not valid JSON"):
        bfcl.load_questions("multiple", tmp_path)
    with pytest.raises(bfcl.BFCLDataError, match="not found"):
        bfcl.load_questions("parallel", tmp_path)
