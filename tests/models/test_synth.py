"""The synthetic BFCL-style task: determinism, disjoint splits, self-consistent ground truth."""

import json

import pytest

from models import synth
from models.checker import check


def test_same_seed_same_examples():
    a = synth.Generator("test", seed=3).examples("parallel_multiple", 5)
    b = synth.Generator("test", seed=3).examples("parallel_multiple", 5)
    c = synth.Generator("test", seed=4).examples("parallel_multiple", 5)
    assert a == b
    assert a != c


def test_splits_disjoint_by_function():
    names = {s: {t["function"]["name"] for t in synth.functions_for(s)} for s in synth.SPLITS}
    assert not names["train"] & names["test"]
    assert not names["train"] & names["dev"]
    assert not names["dev"] & names["test"]
    assert min(len(n) for n in names.values()) > 50


@pytest.mark.parametrize("category", synth.CATEGORIES)
def test_examples_use_only_their_split_and_reference_answer_passes(category):
    test_names = {t["function"]["name"] for t in synth.functions_for("test")}
    for ex in synth.Generator("test", seed=0).examples(category, 15):
        assert {t["function"]["name"] for t in ex.tools} <= test_names
        assert check(ex.tools, ex.answer, ex.ground_truth, category).valid, ex.id
        called = {a["name"] for a in ex.answer}
        assert called <= {t["function"]["name"] for t in ex.tools}


def test_category_shapes():
    gen = synth.Generator("dev", seed=0)
    for ex in gen.examples("multiple", 20):
        assert 2 <= len(ex.tools) <= 6 and len(ex.answer) == 1
    for ex in gen.examples("parallel", 20):
        assert len(ex.tools) == 1 and 2 <= len(ex.answer) <= 4
    for ex in gen.examples("parallel_multiple", 20):
        assert len({a["name"] for a in ex.answer}) >= 2
    for ex in gen.examples("irrelevance", 20):
        assert ex.answer == [] and ex.ground_truth == []


def test_values_appear_in_query():
    for ex in synth.Generator("test", seed=0).examples("simple", 30):
        query = ex.messages[0]["content"]
        for value in ex.answer[0]["arguments"].values():
            if isinstance(value, str):
                assert value in query


def test_renaming_changes_names_but_stays_consistent():
    gen = synth.Generator("train", seed=0, rename_prob=1.0)
    originals = {t["function"]["name"] for t in synth.functions_for("train")}
    renamed = 0
    for ex in gen.examples("multiple", 20):
        renamed += ex.answer[0]["name"] not in originals
        assert check(ex.tools, ex.answer, ex.ground_truth, "multiple").valid
    assert renamed >= 15


def test_long_context_needle_depth():
    gen = synth.Generator("test", seed=0)
    shallow = gen.example("long_context", 0, context_tokens=3000, depth=0.0).messages[0]["content"]
    deep = gen.example("long_context", 0, context_tokens=3000, depth=1.0).messages[0]["content"]
    assert shallow.startswith("Request:")
    assert deep.index("Request:") > 0.8 * len(deep)


def test_bad_arguments():
    with pytest.raises(synth.SynthError, match="unknown split"):
        synth.Generator("validation")
    with pytest.raises(synth.SynthError, match="unknown category"):
        synth.Generator("test").example("simple_python", 0)


def test_examples_are_json_serializable():
    ex = synth.Generator("test").example("parallel_multiple", 1)
    json.dumps(ex.__dict__)
