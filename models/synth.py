"""Synthetic BFCL-style function-calling task built from the real BFCL function definitions.

Every example pairs real BFCL tool schemas (names, descriptions, parameter types, enums, required
lists) with a templated user query that states the intent and the argument values, and with the
ground truth in BFCL's possible-answer format (``[{name: {param: [allowed values]}}]``), so the
same AST checker scores synthetic and real BFCL answers.

Categories (BFCL's names): ``simple``, ``multiple`` (pick 1 of 2-6 functions), ``parallel``
(several calls of one function), ``parallel_multiple``, ``irrelevance`` (no function fits: no
call) and ``long_context`` (long tool list and distractor text, the request planted deep inside;
2,000-4,000 tokens with the embedded tokenizer).

Splits are disjoint by function definition (a hash of the function name), so ``test`` measures
generalization to schemas the model never saw. Generation is deterministic for a seed.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any, Iterator

from models import bfcl, synth_text

CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance", "long_context")
SPLITS = ("train", "dev", "test")
NO_CALL_ANSWER = "None of the available functions can handle this request."
# Characters per token of the embedded tokenizer on tool JSON and filler text (both ~3.7);
# used to size long-context prompts without needing the tokenizer here.
CHARS_PER_TOKEN = 3.7
TEMPLATE_TOKENS = 120  # chat markup and tool instructions around tools and query


class SynthError(ValueError):
    """A bad argument to the generator (unknown split or category, bad size)."""


@dataclass(frozen=True)
class Example:
    """One function-calling example.

    Attributes:
        id: ``{split}_{category}_{index}``.
        category: one of :data:`CATEGORIES`.
        messages: the conversation in OpenAI chat format (user turn last).
        tools: OpenAI ``tools`` entries (JSON Schema parameters).
        ground_truth: BFCL possible-answer format; empty for irrelevance.
        answer: the reference calls ``[{"name": ..., "arguments": {...}}]``; empty means "no call".
    """
    id: str
    category: str
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]]
    ground_truth: list[dict[str, dict[str, list]]]
    answer: list[dict[str, Any]]


def split_of(function_name: str) -> str:
    """The split a function definition belongs to: 80 % train, 10 % dev, 10 % test by name hash."""
    bucket = int(hashlib.md5(function_name.encode()).hexdigest(), 16) % 10
    return "train" if bucket < 8 else ("dev" if bucket == 8 else "test")


_FUNCTIONS_CACHE: dict[str, list[dict[str, Any]]] = {}


def functions_for(split: str) -> list[dict[str, Any]]:
    """The OpenAI-format tool definitions of one split (BFCL functions converted to JSON Schema)."""
    if split not in SPLITS:
        raise SynthError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    if not _FUNCTIONS_CACHE:
        for fn in bfcl.load_functions():
            _FUNCTIONS_CACHE.setdefault(split_of(fn["name"]), []).append(bfcl.to_openai_tool(fn))
    return _FUNCTIONS_CACHE[split]


# ----------------------------------------------------------------------------- value sampling

def _sample_value(rng: random.Random, schema: dict[str, Any], name: str, depth: int = 0) -> Any:
    if "enum" in schema and schema["enum"]:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = rng.choices([(1, 20), (10, 999), (1000, 99999), (-50, -1)], [4, 4, 2, 1])[0]
        lo, hi = max(lo, schema.get("minimum", lo)), min(hi, schema.get("maximum", hi))
        return rng.randint(int(lo), int(hi)) if lo <= hi else int(lo)
    if kind == "number":
        if rng.random() < 0.2:
            return float(rng.randint(1, 500))
        return round(rng.uniform(0.1, rng.choice([10, 100, 5000])), rng.choice([1, 2]))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        items = schema.get("items") or {"type": "string"}
        return [_sample_value(rng, items, name, depth + 1) for _ in range(rng.randint(2, 4))]
    if kind == "object" and depth < 2:
        props = schema.get("properties")
        if not props:
            return {synth_text.identifier(rng, 1): synth_text.string_value(rng, "value")
                    for _ in range(rng.randint(1, 2))}
        required = set(schema.get("required", []))
        chosen = [k for k in props if k in required or rng.random() < 0.5] or [next(iter(props))]
        return {k: _sample_value(rng, props[k], k, depth + 1) for k in chosen}
    return synth_text.string_value(rng, name + " " + schema.get("description", ""))


# ----------------------------------------------------------------------------- one call

@dataclass
class _Call:
    tool: dict[str, Any]
    arguments: dict[str, Any]
    optional_absent: list[str]


def _make_call(rng: random.Random, tool: dict[str, Any], p_optional: float = 0.35) -> _Call:
    params = tool["function"]["parameters"]
    props = params.get("properties", {})
    required = set(params.get("required", []))
    args, absent = {}, []
    for name, schema in props.items():
        if name in required or rng.random() < p_optional:
            args[name] = _sample_value(rng, schema, name)
        else:
            absent.append(name)
    return _Call(tool, args, absent)


def _ground_truth(call: _Call) -> dict[str, dict[str, list]]:
    props = call.tool["function"]["parameters"].get("properties", {})
    truth = {name: [_truth_value(value)] for name, value in call.arguments.items()}
    for name in call.optional_absent:
        allowed = [""]
        default = props[name].get("default")
        if default is not None and default != "" and not isinstance(default, (dict, list)):
            allowed.append(default)
        truth[name] = allowed
    return {call.tool["function"]["name"]: truth}


def _truth_value(value: Any) -> Any:
    # BFCL writes nested dicts with a list of allowed values per key.
    if isinstance(value, dict):
        return {k: [_truth_value(v)] for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_truth_value(v) for v in value]
    return value


def _answer(call: _Call) -> dict[str, Any]:
    return {"name": call.tool["function"]["name"], "arguments": call.arguments}


# ----------------------------------------------------------------------------- renaming

def _rename(rng: random.Random, tool: dict[str, Any]) -> dict[str, Any]:
    """Give a tool a sampled name and, in part, sampled parameter names, so that the model has
    to copy names from the prompt instead of memorizing them (training data only)."""
    fn = tool["function"]
    params = fn["parameters"]
    mapping = {p: (synth_text.identifier(rng, rng.randint(1, 2)) if rng.random() < 0.4 else p)
               for p in params.get("properties", {})}
    if len(set(mapping.values())) < len(mapping):
        mapping = {p: p for p in mapping}
    new_params = dict(params)
    new_params["properties"] = {mapping[k]: v for k, v in params.get("properties", {}).items()}
    if "required" in params:
        new_params["required"] = [mapping[r] for r in params["required"]]
    return {"type": "function", "function": {
        "name": synth_text.function_name(rng), "description": fn.get("description", ""),
        "parameters": new_params}}


# ----------------------------------------------------------------------------- categories

def _similar(a: dict[str, Any], b: dict[str, Any]) -> bool:
    words = lambda t: set(re.findall(r"[a-z]{4,}", (t["function"]["name"] + " " +
                                                     t["function"].get("description", "")).lower()))
    wa, wb = words(a), words(b)
    return bool(wa and wb) and len(wa & wb) / min(len(wa), len(wb)) > 0.5


def _pick(rng: random.Random, pool: list, k: int, exclude: list) -> list:
    names = {t["function"]["name"] for t in exclude}
    out: list = []
    while len(out) < k:
        t = rng.choice(pool)
        if t["function"]["name"] not in names and not any(_similar(t, e) for e in exclude + out):
            out.append(t)
            names.add(t["function"]["name"])
    return out


class Generator:
    """Deterministic generator of :class:`Example` s for one split.

    Args:
        split: ``train``, ``dev`` or ``test``.
        seed: base seed; the same (split, seed, category, index) always gives the same example.
        rename_prob: share of tools renamed with sampled identifiers (use > 0 for training only).
    """

    def __init__(self, split: str, seed: int = 0, rename_prob: float = 0.0):
        self.split, self.seed, self.rename_prob = split, seed, rename_prob
        self.pool = functions_for(split)

    def example(self, category: str, index: int, **kwargs: Any) -> Example:
        if category not in CATEGORIES:
            raise SynthError(f"unknown category {category!r}; choose from {', '.join(CATEGORIES)}")
        rng = random.Random(f"{self.seed}/{self.split}/{category}/{index}")
        self._renaming = bool(self.rename_prob) and rng.random() < self.rename_prob
        tools, calls, plan = getattr(self, "_" + category)(rng, **kwargs)
        query = synth_text.render_query(rng, plan)
        if category != "long_context":
            rng.shuffle(tools)
        return Example(
            id=f"{self.split}_{category}_{index}", category=category,
            messages=[{"role": "user", "content": query}], tools=tools,
            ground_truth=[_ground_truth(c) for c in calls], answer=[_answer(c) for c in calls])

    def examples(self, category: str, num_examples: int, start: int = 0) -> list[Example]:
        if num_examples < 0:
            raise SynthError(f"num_examples must be >= 0, got {num_examples}")
        return [self.example(category, i) for i in range(start, start + num_examples)]

    def stream(self, weights: dict[str, float]) -> Iterator[Example]:
        """An endless stream mixing categories with the given weights (training)."""
        rng = random.Random(f"{self.seed}/{self.split}/stream")
        cats, w = zip(*weights.items())
        index = 0
        while True:
            yield self.example(rng.choices(cats, w)[0], index)
            index += 1

    def _prep(self, rng: random.Random, tools: list) -> list:
        return [_rename(rng, t) for t in tools] if self._renaming else tools

    # Each builder returns (tools, calls, query plan); synth_text renders the plan as the query.
    def _simple(self, rng):
        tool, = self._prep(rng, [rng.choice(self.pool)])
        call = _make_call(rng, tool)
        return [tool], [call], [("single", call)]

    def _multiple(self, rng):
        tool = rng.choice(self.pool)
        tools = self._prep(rng, [tool] + _pick(rng, self.pool, rng.randint(1, 5), [tool]))
        tool = tools[0]
        call = _make_call(rng, tool)
        return tools, [call], [("single", call)]

    def _parallel(self, rng):
        tool, = self._prep(rng, [rng.choice(self.pool)])
        calls = [_make_call(rng, tool, p_optional=0.0) for _ in range(rng.randint(2, 4))]
        return [tool], calls, [("parallel", calls)]

    def _parallel_multiple(self, rng):
        picked = _pick(rng, self.pool, rng.randint(2, 3), [])
        extra = _pick(rng, self.pool, rng.randint(0, 2), picked)
        picked, extra = self._prep(rng, picked), self._prep(rng, extra)
        plan, calls = [], []
        for tool in picked:
            group = [_make_call(rng, tool, p_optional=0.0) for _ in range(rng.choice([1, 1, 2]))]
            calls += group
            plan.append(("single", group[0]) if len(group) == 1 else ("parallel", group))
        return picked + extra, calls, plan

    def _irrelevance(self, rng):
        asked = rng.choice(self.pool)
        tools = self._prep(rng, _pick(rng, self.pool, rng.randint(1, 4), [asked]))
        return tools, [], [("single", _make_call(rng, asked))]

    def _long_context(self, rng, context_tokens: int | None = None, depth: float | None = None):
        """A long tool list plus distractor notes, the request planted at relative ``depth``
        (0 = start of the user message, 1 = end); ``context_tokens`` sets the prompt size."""
        tool = rng.choice(self.pool)
        tools = self._prep(rng, [tool] + _pick(rng, self.pool, rng.randint(6, 12), [tool]))
        tool = tools.pop(0)
        tools.insert(rng.randint(len(tools) // 4, 3 * len(tools) // 4), tool)
        call = _make_call(rng, tool)
        target = context_tokens or rng.randint(2300, 3600)
        tools_chars = sum(len(json.dumps(t)) for t in tools)
        filler_chars = max(400, int((target - TEMPLATE_TOKENS) * CHARS_PER_TOKEN) - tools_chars)
        depth = rng.uniform(0.1, 0.9) if depth is None else depth
        return tools, [call], [("haystack", call, filler_chars, depth)]


# Fixed evaluation sets: the first N examples of each category (seed 0).
EVAL_SIZES = {"dev": {"long_context": 25, "default": 50}, "test": {"long_context": 100, "default": 200}}


def eval_examples(split: str, category: str, seed: int = 0) -> list[Example]:
    """The fixed evaluation set of a split and category (``dev`` or ``test``)."""
    if split not in EVAL_SIZES:
        raise SynthError(f"evaluation sets exist for {', '.join(EVAL_SIZES)}, not {split!r}")
    sizes = EVAL_SIZES[split]
    return Generator(split, seed).examples(category, sizes.get(category, sizes["default"]))
