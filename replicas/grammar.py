"""Constrained decoding with xgrammar: grammar specs, a compiled-grammar cache, time-bounded
compilation, and per-step token bitmasks.

A :class:`GrammarSpec` names what the output must follow: a JSON schema, any JSON object, a
regex, one of several strings (``choice``), an EBNF grammar, or tool calls in the Qwen3
``<tool_call>`` format (xgrammar's ``get_model_structural_tag("qwen_3", ...)``) with each tool's
argument schema and ``tool_choice`` auto / required / none / named.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from replicas.errors import GrammarCompileError

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "tools")


@dataclass(frozen=True)
class GrammarSpec:
    """What the generated text must follow.

    ``value`` by kind: json_schema: a schema (dict or JSON string); json_object: ignored;
    regex: a pattern; choice: a list of strings; ebnf: grammar text (root rule ``root``);
    tools: ``{"tools": [OpenAI tool entries], "tool_choice": "auto" | "required" | "none" |
    {"type": "function", "function": {"name": ...}}, "parallel_tool_calls": bool}``.
    """
    kind: str
    value: Any = None
    strict: bool = False  # json_schema: no properties or items beyond those the schema names

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarCompileError(f"unknown grammar kind {self.kind!r}; choose from {', '.join(KINDS)}")

    def key(self) -> str:
        return self.kind + (":strict:" if self.strict else ":") + json.dumps(self.value, sort_keys=True, default=str)


# Keywords xgrammar 0.2.9 compiles but does not enforce (seen: outputs breaking them under the
# grammar); a schema using one is refused rather than served with output that breaks it.
_UNENFORCED = ("contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentSchemas",
               "unevaluatedProperties", "unevaluatedItems")
_NOT_SCHEMAS = ("const", "enum", "default", "examples", "description", "title", "$comment")
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def unenforced_keywords(schema: Any) -> list[str]:
    """JSON-pointer-ish places where ``schema`` uses a keyword the grammar cannot enforce:
    the keywords above, ``uniqueItems: true``, ``allOf`` with several members, and ``pattern`` or
    ``format`` together with ``minLength`` / ``maxLength`` (the lengths are dropped)."""
    found, stack = [], [(schema, "$")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        found += [f"{k} at {where}" for k in _UNENFORCED if k in node]
        if node.get("uniqueItems") is True:
            found.append(f"uniqueItems at {where}")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.append(f"allOf at {where}")
        if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
            found.append(f"{'pattern' if 'pattern' in node else 'format'} with minLength / maxLength at {where}")
        for k, v in node.items():
            if k in _NAME_MAPS and isinstance(v, dict):
                stack.extend((sub, f"{where}.{k}.{name}") for name, sub in v.items())
            elif k not in _NOT_SCHEMAS:
                stack.append((v, f"{where}.{k}"))
    return found


def _refuse_unenforced(schema: Any, what: str) -> None:
    bad = unenforced_keywords(schema)
    if bad:
        raise GrammarCompileError(f"{what} uses JSON Schema keywords the grammar cannot enforce: "
                                  f"{'; '.join(sorted(bad)[:8])}")


def tools_structural_tag(tools: list[dict], tool_choice: Any = "auto", parallel_tool_calls: bool = True):
    """The xgrammar structural tag for Qwen3-format tool calls.

    Arguments follow the schema's property order: xgrammar 0.2.9's ``any_order=True`` accepts a
    repeated key in place of a missing required one (``{"city": "Paris", "city": "Paris"}`` for
    required ``city`` and ``unit``), which would let schema-breaking output through.
    """
    import xgrammar as xgr
    return xgr.get_model_structural_tag("qwen_3", tools=tools, tool_choice=tool_choice, reasoning=False,
                                        parallel_tool_calls=parallel_tool_calls)


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one tokenizer, with a cache and a time bound.

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        vocab_size: the model's logits width (may exceed the tokenizer's size).
        timeout_s: compilation time bound; past it :class:`GrammarCompileError` is raised.
    """

    def __init__(self, tokenizer, vocab_size: int, timeout_s: float = 10.0, max_threads: int = 2):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self.timeout_s = timeout_s
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    def _compile(self, spec: GrammarSpec):
        c, v = self.compiler, spec.value
        if spec.kind == "json_schema":
            parsed = v
            if isinstance(v, str):
                try:
                    parsed = json.loads(v)
                except json.JSONDecodeError as e:
                    raise GrammarCompileError(f"invalid json_schema grammar: not valid JSON: {e}") from None
            _refuse_unenforced(parsed, "the schema")
            return c.compile_json_schema(json.dumps(parsed), any_whitespace=False, strict_mode=spec.strict)
        if spec.kind == "json_object":
            return c.compile_builtin_json_grammar()
        if spec.kind == "regex":
            return c.compile_regex(v)
        if spec.kind == "choice":
            if not v or not all(isinstance(x, str) for x in v):
                raise GrammarCompileError("choice needs a non-empty list of strings")
            return c.compile_regex("|".join(re.escape(x) for x in v))
        if spec.kind == "ebnf":
            return c.compile_grammar(v)
        tools = v.get("tools") or []
        if not tools:
            raise GrammarCompileError("a tools grammar needs at least one tool")
        for t in tools:
            fn = t.get("function", {})
            _refuse_unenforced(fn.get("parameters"), f"tool {fn.get('name')!r}")
        tag = tools_structural_tag(tools, v.get("tool_choice", "auto"), v.get("parallel_tool_calls", True))
        return c.compile_structural_tag(tag)

    def compile(self, spec: GrammarSpec):
        """Compile (or fetch from the cache) ``spec``.

        Raises:
            GrammarCompileError: xgrammar refused the grammar (its message is included), or
                compilation took longer than ``timeout_s``.
        """
        future = self._pool.submit(self._compile, spec)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarCompileError(f"{spec.kind} grammar did not compile within {self.timeout_s:g} s") from None
        except GrammarCompileError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            raise GrammarCompileError(f"invalid {spec.kind} grammar: {e}") from None

    def matcher(self, spec: GrammarSpec):
        """A fresh ``xgrammar.GrammarMatcher`` for one request."""
        return self.xgr.GrammarMatcher(self.compile(spec))

    def apply_bitmask(self, logits: torch.Tensor, matchers: list) -> None:
        """Mask, in place, the tokens each row's matcher forbids (rows without a matcher untouched).

        Args:
            logits: ``[B, vocab]`` float32, on any device.
            matchers: ``B`` entries, each a matcher or None.
        """
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        index = rows if len(rows) < len(matchers) else None
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=index)
