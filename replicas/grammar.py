"""Constrained decoding with xgrammar: grammar specs, a compiled-grammar cache, time-bounded
compilation, and per-step token bitmasks.

A :class:`GrammarSpec` names what the output must follow: a JSON schema, any JSON object, a
regex, one of several strings (``choice``), an EBNF or Lark grammar, or tool calls in the Qwen3
``<tool_call>`` format (xgrammar's ``get_model_structural_tag("qwen_3", ...)``) with each tool's
argument schema and ``tool_choice`` auto / required / none / named.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from replicas.errors import GrammarCompileError

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "lark", "tools")


@dataclass(frozen=True)
class GrammarSpec:
    """What the generated text must follow.

    ``value`` by kind: json_schema: a schema (dict or JSON string); json_object: ignored;
    regex: a pattern; choice: a list of strings; ebnf: grammar text (GBNF, root rule ``root``);
    lark: Lark grammar text (start rule ``start``, as vLLM / llguidance take it);
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
    the keywords above, ``uniqueItems: true``, ``allOf`` with several members, ``pattern`` or
    ``format`` together with ``minLength`` / ``maxLength`` (the lengths are dropped), ``anyOf`` /
    ``oneOf`` / ``allOf`` / ``$ref`` beside other constraints (the siblings are dropped), ``oneOf``
    whose members may overlap (it is compiled as ``anyOf``), a ``required`` name missing from
    ``properties``, ``enum`` / ``const`` values outside the node's ``type``, and a ``$ref`` that is
    not a local JSON pointer (it would match anything). Seen with xgrammar 0.2.9: output breaking
    the schema under the grammar."""
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
        found += _dropped_constraints(node, where)
        for k, v in node.items():
            if k in _NAME_MAPS and isinstance(v, dict):
                stack.extend((sub, f"{where}.{k}.{name}") for name, sub in v.items())
            elif k not in _NOT_SCHEMAS:
                stack.append((v, f"{where}.{k}"))
    return found


_CONSTRAINTS = ("type", "properties", "required", "items", "prefixItems", "additionalProperties",
                "patternProperties", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                "multipleOf", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
                "minProperties", "maxProperties", "propertyNames")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


def _matches_type(value: Any, types: Any) -> bool:
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list):
        return True
    for t in types:
        py = _JSON_TYPES.get(t)
        if py is None:
            return True  # an unknown type name: xgrammar reports it
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if t == "integer" and isinstance(value, float) and value.is_integer():
            return True
        if isinstance(value, py):
            return True
    return False


def _disjoint_members(members: list) -> bool:
    """oneOf members that no value can match twice: distinct single types (not integer beside
    number), or const / enum values that do not repeat."""
    types = [m.get("type") if isinstance(m, dict) else None for m in members]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) \
            and not {"integer", "number"} <= set(types):
        return True
    values = []
    for m in members:
        if not isinstance(m, dict) or not ("const" in m or isinstance(m.get("enum"), list)):
            return False
        values += [m["const"]] if "const" in m else m["enum"]
    keys = [json.dumps(v, sort_keys=True) for v in values]
    return len(set(keys)) == len(keys)


def _atom_end(p: str, i: int) -> int:
    """Index just past the regex atom starting at ``p[i]`` (an escape, a class, a group, a char)."""
    if p[i] == "\\":
        return min(i + 2, len(p))
    if p[i] == "[":
        j = i + 1
        if j < len(p) and p[j] == "^":
            j += 1
        if j < len(p) and p[j] == "]":
            j += 1
        while j < len(p) and p[j] != "]":
            j += 2 if p[j] == "\\" else 1
        return min(j + 1, len(p))
    if p[i] == "(":
        depth, j = 0, i
        while j < len(p):
            if p[j] == "\\":
                j += 2
                continue
            if p[j] == "[":
                j = _atom_end(p, j)
                continue
            depth += p[j] == "("
            depth -= p[j] == ")"
            j += 1
            if depth == 0:
                return j
        return len(p)
    return i + 1


def _may_repeat_zero(p: str, i: int) -> bool:
    return i < len(p) and (p[i] in "*?" or p.startswith("{0", i) or p.startswith("{,", i))


def _top_level_atoms(p: str):
    """(start, end) of each top-level atom of ``p`` (a group counts as one)."""
    i = 0
    while i < len(p):
        j = _atom_end(p, i)
        yield i, j
        i = j


def optional_group_starting_optional(pattern: str) -> bool:
    """Whether ``pattern`` has a group that may be skipped (``(...)?``, ``(...)*``) whose body, or
    one of its alternatives, starts with an atom that may be empty (``(\\s*\\+json)?``). xgrammar
    0.2.9 then accepts the empty-able atom alone: ``^v(x*j)?$`` accepted ``"vx"`` (seen in a
    JSONSchemaBench MIME-type pattern: output ``"video/s_data "`` broke it)."""
    stack = [pattern]  # group bodies still to look into (no recursion: nesting is the client's)
    while stack:
        p = stack.pop()
        for i, j in _top_level_atoms(p):
            if p[i] != "(":
                continue
            body = p[i + 1:j - 1]
            if body.startswith("?:"):
                body = body[2:]
            elif body.startswith("?<") and body[2:3] not in ("=", "!"):  # a named group
                body = body[body.find(">") + 1:]
            if _may_repeat_zero(p, j):
                alts, start = [], 0
                for k, m in _top_level_atoms(body):
                    if body[k] == "|":
                        alts.append(body[start:k])
                        start = m
                alts.append(body[start:])
                if any(alt and _may_repeat_zero(alt, _atom_end(alt, 0)) for alt in alts):
                    return True
            stack.append(body)
    return False


def _dropped_constraints(node: dict, where: str) -> list[str]:
    found = []
    if isinstance(node.get("pattern"), str) and optional_group_starting_optional(node["pattern"]):
        found.append(f"pattern with an optional group that starts with an optional atom at {where}")
    siblings = [k for k in _CONSTRAINTS if k in node]
    for comb in ("anyOf", "oneOf", "allOf", "$ref"):
        if comb in node and siblings:
            found.append(f"{comb} beside {', '.join(siblings)} at {where}")
    if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1 and not _disjoint_members(node["oneOf"]):
        found.append(f"oneOf with members that may overlap at {where}")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        found.append(f"$ref {ref[:60]!r} (not a local JSON pointer) at {where}")
    required, props = node.get("required"), node.get("properties")
    if isinstance(required, list):
        missing = [r for r in required if not (isinstance(props, dict) and r in props)]
        if missing:
            found.append(f"required {', '.join(map(str, missing[:4]))} not in properties at {where}")
    if "type" in node:
        values = ([node["const"]] if "const" in node else []) + (node["enum"] if isinstance(node.get("enum"), list) else [])
        if any(not _matches_type(v, node["type"]) for v in values):
            found.append(f"enum / const values outside type {node['type']} at {where}")
    return found


def _refuse_unenforced(schema: Any, what: str) -> None:
    bad = unenforced_keywords(schema)
    if bad:
        raise GrammarCompileError(f"{what} uses JSON Schema keywords the grammar cannot enforce: "
                                  f"{'; '.join(sorted(bad)[:8])}")


# Longest run of whitespace allowed between the tokens of a call's arguments (the model and the
# chat template write one space; unbounded, a weak model could fill max_tokens with newlines).
TOOLS_MAX_WHITESPACE = 2


def tools_structural_tag(tools: list[dict], tool_choice: Any = "auto", parallel_tool_calls: bool = True):
    """The xgrammar structural tag for Qwen3-format tool calls.

    Arguments follow the schema's property order: xgrammar 0.2.9's ``any_order=True`` accepts a
    repeated key in place of a missing required one (``{"city": "Paris", "city": "Paris"}`` for
    required ``city`` and ``unit``), which would let schema-breaking output through. Whitespace
    runs inside the arguments are at most :data:`TOOLS_MAX_WHITESPACE` characters.
    """
    import xgrammar as xgr
    return xgr.get_model_structural_tag("qwen_3", tools=tools, tool_choice=tool_choice, reasoning=False,
                                        parallel_tool_calls=parallel_tool_calls,
                                        max_whitespace_cnt=TOOLS_MAX_WHITESPACE)


def _check(spec: GrammarSpec) -> GrammarSpec:
    """What the compiler refuses before compiling. Returns the spec to compile (a json_schema
    given as text comes back parsed, so the compiler process does not parse and check it again)."""
    v = spec.value
    if spec.kind == "json_schema":
        parsed = v
        if isinstance(v, str):
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError as e:
                raise GrammarCompileError(f"invalid json_schema grammar: not valid JSON: {e}") from None
        _refuse_unenforced(parsed, "the schema")
        return GrammarSpec("json_schema", parsed, spec.strict)
    if spec.kind == "choice" and (not v or not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
        raise GrammarCompileError("choice needs a non-empty list of strings")
    if spec.kind in ("ebnf", "lark", "regex") and (not isinstance(v, str) or not v.strip()):
        raise GrammarCompileError(f"a {spec.kind} grammar needs non-empty text")
    if spec.kind == "tools":
        tools = (v or {}).get("tools") or []
        if not tools:
            raise GrammarCompileError("a tools grammar needs at least one tool")
        for t in tools:
            fn = t.get("function", {})
            _refuse_unenforced(fn.get("parameters"), f"tool {fn.get('name')!r}")
    return spec


def _compile_with(compiler, spec: GrammarSpec):
    """Compile a spec :func:`_check` returned, with an ``xgrammar.GrammarCompiler``."""
    v = spec.value
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(json.dumps(v), any_whitespace=False, strict_mode=spec.strict)
    if spec.kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if spec.kind == "regex":
        return compiler.compile_regex(v)
    if spec.kind == "choice":
        return compiler.compile_regex("|".join(re.escape(x) for x in v))
    if spec.kind == "ebnf":
        return compiler.compile_grammar(v)
    if spec.kind == "lark":
        import xgrammar as xgr
        return compiler.compile_grammar(xgr.Grammar.from_lark(v))
    tag = tools_structural_tag(v["tools"], v.get("tool_choice", "auto"), v.get("parallel_tool_calls", True))
    return compiler.compile_structural_tag(tag)


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes
    return ctypes.CDLL("libc.so.6")


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``). Deserializing a large
    grammar allocates and frees hundreds of MB in small blocks that glibc otherwise keeps: without
    it a process that deserialized 60 Github_hard grammars (none kept) held 2.4 GiB, with it 0.5."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _clean(message: str) -> str:
    """xgrammar's message without its log prefix (time, C++ source file and line)."""
    return " ".join(re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", message).split())


def _compile_worker(info_json: str, conn) -> None:
    """The compiler process: compile specs from ``conn`` and send back serialized grammars."""
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1)
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", _compile_with(compiler, spec).serialize_json()))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            conn.send(("error", str(e)))


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one tokenizer, in a child process, with a cache.

    Compilation runs in a separate process (``isolate=True``) that is killed and replaced when it
    passes ``timeout_s``, dies or holds more than ``memory_bytes`` of resident memory: a schema that crashes, hangs or
    explodes the compiler costs its request a :class:`GrammarCompileError`, never the replica. The
    compiled grammar comes back serialized (xgrammar's JSON form). Compiled grammars are cached
    by spec, least recently used first out, within ``cache_bytes``, each counted by the size of
    its serialized form: a deserialized grammar held about 0.8x that, while xgrammar's
    ``memory_size_bytes`` said 20-60x less (Github_hard schemas: 0.2-2.7 MB reported for grammars
    of 0.8-161 MB serialized), and a replica counting by it grew to 6 GiB and was killed by the
    node's memory monitor.

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        vocab_size: the model's logits width (may exceed the tokenizer's size).
        timeout_s: compilation time bound; past it :class:`GrammarCompileError` is raised.
        isolate: compile in the child process (False: in a thread of this process, where a hung
            compilation cannot be stopped; for tools that compile many grammars in one process).
        memory_bytes: resident-memory bound of the compiler process, watched while it compiles
            (3 GiB; the process holds about 0.5 GiB after importing xgrammar). Without a bound one
            JSONSchemaBench schema (Github_hard #86) exhausted a 24 GiB node and Ray killed the
            replica; an address-space cap instead refused most Github_ultra schemas (thread
            stacks and allocator arenas count there).
        cache_bytes: bound of the compiled-grammar cache.
    """

    def __init__(self, tokenizer, vocab_size: int, timeout_s: float = 10.0, max_threads: int = 2,
                 isolate: bool = True, memory_bytes: int = 3 << 30, cache_bytes: int = 256 << 20):
        import collections
        import threading

        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.timeout_s, self.vocab_size, self.isolate = timeout_s, vocab_size, isolate
        self.memory_bytes, self.cache_bytes = memory_bytes, cache_bytes
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._proc = self._conn = None
        self._bitmask = self._batch = None   # the reused batch bitmask and xgrammar batch matcher
        if not isolate:
            self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    # ------------------------------------------------------------------ the compiler process
    def _start(self) -> None:
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_compile_worker, args=(self.info.serialize_json(), child),
                                 daemon=True, name="grammar-compiler")
        self._proc.start()
        child.close()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _rss(self) -> int:
        """Resident memory of the compiler process, bytes (0 if it cannot be read)."""
        import psutil
        try:
            return psutil.Process(self._proc.pid).memory_info().rss
        except (psutil.Error, AttributeError):
            return 0

    def _compile_isolated(self, spec: GrammarSpec):
        started = self._proc is None or not self._proc.is_alive()
        if started:
            self._start()
        self._conn.send(spec)
        # A fresh process first imports xgrammar: that wait is not the grammar's.
        deadline = time.monotonic() + self.timeout_s + (60 if started else 0)
        while not self._conn.poll(0.05):
            if time.monotonic() > deadline:
                self._stop()
                raise GrammarCompileError(f"{spec.kind} grammar did not compile within {self.timeout_s:g} s")
            if self._rss() > self.memory_bytes:
                self._stop()
                raise GrammarCompileError(f"{spec.kind} grammar needs more than the compiler's "
                                          f"{self.memory_bytes / 2**30:g} GiB of memory")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            self._stop()
            raise GrammarCompileError(f"the grammar compiler died on this {spec.kind} grammar") from None
        if (status != "ok" and "bad_alloc" in payload) or self._rss() > self.memory_bytes // 2:
            # The process keeps what it grew to: a fresh one, so that the next grammar is not
            # refused for memory a previous one took.
            self._stop()
        if status != "ok":
            raise GrammarCompileError(f"invalid {spec.kind} grammar: {_clean(payload)}")
        compiled = self.xgr.CompiledGrammar.deserialize_json(payload, self.info)
        size = len(payload)
        del payload
        _trim_heap()
        return compiled, size

    # ------------------------------------------------------------------ compile + cache
    def compile(self, spec: GrammarSpec):
        """Compile (or fetch from the cache) ``spec``.

        Raises:
            GrammarCompileError: refused before compiling (keywords the grammar cannot enforce,
                malformed input), xgrammar refused it (its message is included), or compilation
                passed ``timeout_s``, died or ran out of memory.
        """
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
            spec = _check(spec)
            if self.isolate:
                compiled, size = self._compile_isolated(spec)
            else:
                compiled = self._compile_in_thread(spec)
                size = compiled.memory_size_bytes
            if size <= self.cache_bytes:
                self._cache[key] = (compiled, size)
                self._cached_bytes += size
                evicted = False
                while self._cached_bytes > self.cache_bytes:
                    _, (_, old_size) = self._cache.popitem(last=False)
                    self._cached_bytes -= old_size
                    evicted = True
                if evicted:
                    _trim_heap()
            return compiled

    def _compile_in_thread(self, spec: GrammarSpec):
        future = self._pool.submit(_compile_with, self.compiler, spec)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarCompileError(f"{spec.kind} grammar did not compile within {self.timeout_s:g} s") from None
        except GrammarCompileError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            raise GrammarCompileError(f"invalid {spec.kind} grammar: {_clean(str(e))}") from None

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
        n = len(matchers)
        if self._bitmask is None or self._bitmask.shape[0] < n:   # one buffer, reused every step
            self._bitmask = self.xgr.allocate_token_bitmask(max(n, 8), self.vocab_size)
            self._batch = self.xgr.BatchGrammarMatcher()
        bitmask = self._bitmask[:n]
        # xgrammar's batch API: the rows are filled in one call (on its thread pool).
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, indices=rows)
        index = rows if len(rows) < n else None
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=index)
