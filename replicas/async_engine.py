"""Asynchronous streaming wrapper around :class:`LLMEngine` for a Ray Serve replica (or any
asyncio server).

The engine steps in one background thread; each request streams its :class:`RequestOutput` s
through an asyncio queue of the caller's event loop. A consumer that stops iterating (client
disconnect, timeout, cancellation) aborts its request, which frees its KV cache.

A request's grammar compiles off the engine loop: the request is checked and held by the engine
(not scheduled), the compile runs in a thread of this wrapper (the compiler's own process, cache
and bounds, as ``LLMEngine`` uses them), and only then is the request scheduled. Running streams
keep stepping meanwhile; before this, the compile ran in ``add_request`` under the loop's lock and
every stream stopped for it (``compile_inline=True`` keeps that behaviour, for
``bench.compile_stall``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from typing import AsyncIterator

from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.grammar import GrammarSpec
from replicas.sampling_params import SamplingParams
from replicas.sequence import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop failed; in-flight requests end with this error."""


class AsyncLLMEngine:
    """Args:
        engine: the engine, owned by this wrapper's loop thread from now on.
        compile_inline: compile grammars in ``add_request`` under the loop's lock, stalling every
            stream for the compile (the old behaviour; for comparison only).
    """

    def __init__(self, engine: LLMEngine, compile_inline: bool = False):
        self.engine = engine
        self.compile_inline = compile_inline
        self._compiles = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._ids = itertools.count()
        self._probes: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLMEngine":
        return cls(LLMEngine(config))

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, grammar: GrammarSpec | None = None,
                       kv_budget: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs until it finishes.

        Raises:
            InvalidRequestError: from ``LLMEngine.add_request``, before anything is generated
                (``GrammarCompileError`` for a grammar that does not compile, after its compile).
            EngineDeadError: the engine loop failed while the request was in flight.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        held = grammar is not None and not self.compile_inline
        with self._lock:
            self.engine.add_request(request_id, prompt, params, grammar, kv_budget, compile_grammar=not held)
            self._queues[request_id] = (loop, queue)
            compiler = self.engine.grammar if held else None   # (built here, not in two threads at once)
        finished = False
        try:
            if held:   # compiled off the loop; an abort (the consumer gone) meanwhile drops the request
                matcher = await loop.run_in_executor(self._compiles, compiler.matcher, grammar)
                with self._lock:
                    ready = self.engine.grammar_ready(request_id, matcher)
                if not ready:   # aborted meanwhile; by a failed step, whose error is on its way here
                    await asyncio.sleep(0)
                    if not queue.empty() and isinstance(error := queue.get_nowait(), BaseException):
                        raise error
                    return
            self._wake.set()
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def call(self, fn):
        """Run ``fn(engine)`` between engine steps (under the loop's lock) and return its result."""
        with self._lock:
            return fn(self.engine)

    async def ping(self, timeout_s: float = 30.0) -> None:
        """Wait until the engine loop thread comes round between two steps: a health check that
        goes through the loop, so a loop stuck in a step (or dead) fails it.

        Raises:
            EngineDeadError: the loop thread is not running, or did not come round in ``timeout_s``.
        """
        if self._stopped or not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._probes.append((loop, fut))
        self._wake.set()
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"the engine loop did not come round between steps in {timeout_s:g} s") from None

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)
            self.engine.abort(request_id)

    def _deliver(self, request_id: str, item) -> None:
        entry = self._queues.get(request_id)
        if entry is None:
            return
        loop, queue = entry
        if getattr(item, "finished", True):
            self._queues.pop(request_id, None)
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def _answer_probes(self) -> None:
        while self._probes:
            loop, fut = self._probes.pop()
            try:
                loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))
            except RuntimeError:  # the caller's event loop has closed: nobody waits any more
                pass

    def _loop(self) -> None:
        while not self._stopped:
            self._answer_probes()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            with self._lock:
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug in a step must not hang the callers
                    error = EngineDeadError(f"engine step failed: {type(e).__name__}: {e}")
                    for rid in list(self._queues):
                        self.engine.abort(rid)
                        self._deliver(rid, error)
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        self._compiles.shutdown(wait=False, cancel_futures=True)
