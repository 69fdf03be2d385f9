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

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarCompileError(f"unknown grammar kind {self.kind!r}; choose from {', '.join(KINDS)}")

    def key(self) -> str:
        return self.kind + ":" + json.dumps(self.value, sort_keys=True, default=str)


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
            schema = v if isinstance(v, str) else json.dumps(v)
            return c.compile_json_schema(schema, any_whitespace=False, strict_mode=False)
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
