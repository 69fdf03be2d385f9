"""Hand-written cases for each BFCL AST rule (models.checker)."""

import pytest

from models.checker import check, standardize_string

AREA = {"name": "calc.area", "description": "Area of a rectangle.", "parameters": {
    "type": "dict", "required": ["width", "height"], "properties": {
        "width": {"type": "float"}, "height": {"type": "integer"},
        "unit": {"type": "string", "default": "m"},
        "rounded": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "meta": {"type": "dict", "properties": {"owner": {"type": "string"}, "year": {"type": "integer"}}}}}}
TRUTH = [{"calc.area": {"width": [2.5, 3.0], "height": [4], "unit": ["", "m", "meters"],
                        "rounded": ["", False], "tags": ["", ["red", "blue"]],
                        "meta": ["", {"owner": ["Ann"], "year": ["", 2020]}]}}]


def call(**args):
    return [{"name": "calc.area", "arguments": args}]


@pytest.mark.parametrize("args, valid, why", [
    ({"width": 2.5, "height": 4}, True, "optional parameters left out"),
    ({"width": 3, "height": 4}, True, "int accepted for float"),
    ({"width": 2.5, "height": 4.0}, False, "float not accepted for int"),
    ({"width": "2.5", "height": 4}, False, "string for a number"),
    ({"width": 2.5}, False, "missing required parameter"),
    ({"width": 2.5, "height": 4, "color": "red"}, False, "parameter outside the schema"),
    ({"width": 2.5, "height": 5}, False, "value not allowed"),
    ({"width": 2.5, "height": 4, "unit": "Meters"}, True, "string case ignored"),
    ({"width": 2.5, "height": 4, "unit": " m-e.t_e/r*s^ "}, True, "spaces and ,./-_*^ ignored"),
    ({"width": 2.5, "height": 4, "unit": "feet"}, False, "string not allowed"),
    ({"width": 2.5, "height": 4, "rounded": 0}, False, "int is not a boolean"),
    ({"width": 2.5, "height": 4, "rounded": False}, True, "boolean allowed"),
    ({"width": 2.5, "height": 4, "tags": ["Red", "blue"]}, True, "list strings normalized"),
    ({"width": 2.5, "height": 4, "tags": ["blue", "red"]}, False, "list order matters"),
    ({"width": 2.5, "height": 4, "meta": {"owner": "ann"}}, True, "dict: optional key left out"),
    ({"width": 2.5, "height": 4, "meta": {"owner": "Ann", "year": 2021}}, False, "dict: bad value"),
    ({"width": 2.5, "height": 4, "meta": {"year": 2020}}, False, "dict: required key missing"),
])
def test_simple_rules(args, valid, why):
    assert check([AREA], call(**args), TRUTH, "simple").valid is valid, why


def test_wrong_function_name_and_count():
    assert not check([AREA], [{"name": "calc_area", "arguments": {"width": 2.5, "height": 4}}],
                     TRUTH, "simple").valid
    assert not check([AREA], call(width=2.5, height=4) * 2, TRUTH, "simple").valid
    assert not check([AREA], [], TRUTH, "simple").valid


def test_parameter_omitted_without_empty_option_fails():
    truth = [{"calc.area": {"width": [2.5], "height": [4], "unit": ["m"]}}]
    assert not check([AREA], call(width=2.5, height=4), truth, "simple").valid
    assert check([AREA], call(width=2.5, height=4, unit="m"), truth, "simple").valid


def test_parallel_any_order_each_call_used_once():
    truth = [{"calc.area": {"width": [1.0], "height": [1]}}, {"calc.area": {"width": [2.0], "height": [2]}}]
    a, b = call(width=1.0, height=1), call(width=2.0, height=2)
    assert check([AREA], a + b, truth, "parallel").valid
    assert check([AREA], b + a, truth, "parallel").valid
    assert not check([AREA], a + a, truth, "parallel").valid
    assert not check([AREA], a, truth, "parallel").valid


def test_multiple_picks_schema_by_ground_truth_name():
    other = {"name": "calc.volume", "parameters": {"type": "dict", "properties": {"side": {"type": "float"}},
                                                   "required": ["side"]}}
    assert check([other, AREA], call(width=2.5, height=4), TRUTH, "multiple").valid
    assert not check([other, AREA], [{"name": "calc.volume", "arguments": {"side": 1.0}}], TRUTH,
                     "multiple").valid


def test_irrelevance_means_no_call():
    assert check([AREA], [], [], "irrelevance").valid
    assert not check([AREA], call(width=1.0, height=1), [], "irrelevance").valid


def test_json_schema_tools_accepted():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}
    assert check([tool], [{"name": "f", "arguments": {"x": 1}}], [{"f": {"x": [1.0]}}], "simple").valid


def test_variable_answers_compared_exactly():
    # BFCL: an allowed value whose type differs from the schema's is a variable name.
    truth = [{"calc.area": {"width": ["w"], "height": [4]}}]
    assert check([AREA], call(width="w", height=4), truth, "simple").valid
    assert not check([AREA], call(width="W", height=4), truth, "simple").valid


def test_standardize_string():
    assert standardize_string("New York, NY") == standardize_string("new-york ny")
    assert standardize_string("it's") == 'it"s'
