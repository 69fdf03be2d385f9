"""The engine loop: schedule, run the model, sample, postprocess.

    engine = LLMEngine(EngineConfig())
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        for out in engine.step(): ...
"""

from __future__ import annotations

import itertools
import logging
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from models import resolve_checkpoint
from replicas.config import EngineConfig
from replicas.detokenizer import IncrementalDetokenizer, token_bytes_of
from replicas.errors import InvalidRequestError
from replicas.grammar import GrammarCompiler, GrammarSpec
from replicas.jump_forward import ForcedTokenizer, forced_tokens
from replicas.kv_cache import KVCache, KVCacheConfig, KVCacheOutOfMemory, Precision
from replicas.model_runner import ModelRunner, PrefillChunk
from replicas.models import load_model
from replicas.models.llama import prepack_linears
from replicas.policies import make_policy
from replicas.policy import PrefillView
from replicas.prefix_cache import check_policy
from replicas.sampler import sample
from replicas.sampling_params import SamplingParams
from replicas.scheduler import PrefillWork, Scheduler, SchedulerConfig
from replicas.sequence import RequestOutput, Sequence, SequenceStatus, TokenLogprob
from replicas.prompt_labels import prompt_labels
from replicas.tagger import StructuralTagger

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

logger = logging.getLogger(__name__)


def build_rank(config: EngineConfig, rank: int, world_size: int, port: int, addr: str = "127.0.0.1",
               device_index: int | None = None) -> tuple[ModelRunner, KVCache]:
    """Load the model shard and KV cache of one tensor-parallel rank (the whole model at TP=1).

    ``device_index``: the CUDA device of this rank (default: ``rank``; 0 under Ray, which shows
    each worker only its own GPU)."""
    from replicas import tp
    device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if config.device == "auto" else config.device))
    if device.type == "cuda" and world_size > 1:
        device = torch.device("cuda", rank if device_index is None else device_index)
    dtype = _DTYPES.get(config.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = load_model(resolve_checkpoint(config.model), dtype, device)
    mc = model.config
    if world_size > 1:
        tp.init_distributed(rank, world_size, port, device, addr)
        tp.shard_model(model, rank, world_size)
    if device.type == "cpu":   # oneDNN-blocked weights: the projections 1.4-1.5x faster at decode batch 8
        prepack_linears(model)
    # On the CPU an unused pool costs nothing (pages are committed when written), so every pool is
    # there and a policy can be swapped; on CUDA only the pools the policy stores into are reserved.
    precisions = (make_policy(config.kv_policy, **config.kv_policy_args).spec.precisions
                  if device.type == "cuda" else (Precision.HIGH, Precision.INT8, Precision.INT4))
    kv = KVCache(KVCacheConfig(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads // world_size,
                               head_dim=mc.head_dim, dtype=dtype, block_size=config.block_size,
                               max_bytes=config.kv_cache_bytes, device=str(device),
                               # with a prefix cache a prompt in progress may have a shadow row
                               max_num_seqs=config.max_num_seqs * (2 if config.enable_prefix_caching else 1),
                               max_model_len=config.max_model_len or mc.max_position_embeddings,
                               precisions=precisions))
    return ModelRunner(model, kv, device), kv


def _detokenizer(tokenizer):
    """``ids -> text`` without special tokens, run on every sequence every step. The Rust
    tokenizer itself where transformers' ``decode`` adds nothing but a Python pass over the ids
    (0.26 ms a step at batch 8 by the 256th token); ``decode`` where it cleans up spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


class TokenText(dict):
    """Token id -> its text with special tokens spelled out (what ``tokenizer.decode([id])``
    gives), decoded once per id: the structural tagger reads every generated token's text."""

    def __init__(self, tokenizer):
        super().__init__()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode = lambda t: backend.decode([t], skip_special_tokens=False)
        else:
            self._decode = lambda t: tokenizer.decode([t])

    def __missing__(self, token: int) -> str:
        text = self[token] = self._decode(token)
        return text


def _tagger_for(grammar: GrammarSpec | None) -> StructuralTagger:
    """The structural tagger matching a request's output format."""
    if grammar is not None and grammar.kind == "tools":
        return StructuralTagger(tools=grammar.value.get("tools"))
    if grammar is not None and grammar.kind == "json_schema":
        schema = grammar.value if isinstance(grammar.value, dict) else json.loads(grammar.value)
        return StructuralTagger(json_schema=schema)
    if grammar is not None and grammar.kind == "json_object":
        return StructuralTagger(json_schema={})
    return StructuralTagger()


class _AtLength:
    """``seq`` as it was when it held ``num_tokens`` tokens (what ``decode_targets`` reads for
    the token at ``num_tokens - 1``); every other attribute is the sequence's."""

    def __init__(self, seq: Sequence, num_tokens: int):
        self._seq, self.num_tokens = seq, num_tokens

    def __getattr__(self, name):
        return getattr(self._seq, name)


class LLMEngine:
    """Continuous-batching engine over a compressible KV cache (one process, one rank)."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoTokenizer
        from replicas import tp
        self.config = config
        path = resolve_checkpoint(config.model)
        world = config.tensor_parallel_size
        if config.enable_prefix_caching:
            check_policy(config.kv_policy, world)
        self._workers: list = []
        port, addr = (tp.free_port() if world > 1 else 0), "127.0.0.1"
        device_index = None
        if world > 1:
            under_ray = tp.current_placement_group(world) is not None
            self._workers, addr = tp.start_workers(world, port, config)
            device_index = 0 if under_ray else None
        self.runner, self.kv = build_rank(config, 0, world, port, addr, device_index)
        self.model, self.device = self.runner.model, self.runner.device
        if world > 1:
            broadcaster = tp.Broadcaster()
            self.kv = tp.MirroredKVCache(self.kv, broadcaster)
            self.runner = tp.MirroredRunner(self.runner, broadcaster)
        mc = self.model.config
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._detokenize = _detokenizer(self.tokenizer)
        self._token_bytes = token_bytes_of(self.tokenizer)   # byte-level vocabularies: one decode a token
        self._token_text = TokenText(self.tokenizer)
        self.eos_token_ids = set(mc.eos_token_ids) | self._generation_eos(path)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.policy = make_policy(config.kv_policy, **config.kv_policy_args)
        self.policy.bind_model(path)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.enable_chunked_prefill,
                                                   self.policy.spec.compresses_chunks), self.kv)
        if config.kv_budget < 1.0:  # a default budget no prompt can meet is a configuration error
            try:
                self.policy.check(self.max_model_len, config.kv_budget, self.kv)
            except ValueError as e:
                raise ValueError(f"kv_policy {config.kv_policy!r} cannot serve kv_budget {config.kv_budget}: {e}") from None
            if config.kv_budget < self.policy.floor_cost:   # the floors depend on each prompt: warn, not refuse
                logger.warning("kv_budget %.4g is below kv_policy %r's floors on its calibration data (%.4g of full KV): "
                               "requests that send no kv_budget will mostly be refused", config.kv_budget,
                               config.kv_policy, self.policy.floor_cost)
        if not config.enforce_eager:
            from replicas.decode_graph import DecodeGraph
            self.runner.graph = DecodeGraph(self.model, self.kv, self.policy.spec.precisions, config.max_num_seqs,
                                            record_queries=self.policy.spec.record_decode_queries)
        self.generator = torch.Generator().manual_seed(config.seed)
        # Jump-forward only where the policy takes generated tokens as a chunk (else: no change).
        self.jump_forward = config.enable_jump_forward and self.policy.spec.forced_chunks
        self._forced_tokenizer = ForcedTokenizer(self.tokenizer, self._token_text, self.eos_token_ids)
        self._grammar: GrammarCompiler | None = None
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.replica_budget = 1.0   # set by the cluster budget controller (cluster/controller.py)
        self.table_versions: dict[str, str] = {}
        if config.enable_prefix_caching:
            self._enable_prefix_cache()

    def _enable_prefix_cache(self) -> None:
        spec = self.policy.spec
        keep = spec.observation_window + (1 if spec.wants_window_ppl else 0)
        self.kv.enable_prefix_cache(self._prefix_key(), shadow=not spec.shares_prompt_pages, keep=keep)

    def close(self) -> None:
        """Stop the grammar compiler process and the tensor-parallel workers."""
        if self._grammar is not None:
            self._grammar.close()
        if self._workers:
            import torch.distributed as dist
            dist.broadcast_object_list([("stop", ())], src=0)
            for p in self._workers:
                p.join(timeout=30)
            dist.destroy_process_group()
            self._workers = []

    @staticmethod
    def _generation_eos(path: Path) -> set[int]:
        f = path / "generation_config.json"
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        return set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))

    @property
    def grammar(self) -> GrammarCompiler:
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.tokenizer, self.model.config.vocab_size,
                                            self.config.grammar_timeout_s,
                                            memory_bytes=self.config.grammar_memory_bytes)
        return self._grammar

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    grammar: GrammarSpec | None = None, kv_budget: float | None = None,
                    compile_grammar: bool = True) -> None:
        """Queue a request.

        ``compile_grammar=False`` (with a ``grammar``): the request is checked and held, not
        scheduled, until :meth:`grammar_ready` hands it its matcher (``AsyncLLMEngine`` compiles
        off the engine loop meanwhile; vLLM v1's WAITING_FOR_FSM); :meth:`abort` drops it.

        Raises:
            InvalidRequestError: duplicate id, empty prompt, token ids outside the vocabulary, prompt
                plus ``max_tokens`` longer than the context or than the KV pool, a budget outside
                (0, 1]; ``GrammarCompileError`` (a subclass) for a grammar that does not compile.
        """
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt has token ids outside [0, {vocab}): {bad[:5]}")
        for field, ids_ in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids_ if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"{field} has token ids outside [0, {vocab}): {bad[:5]}", field)
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                                      f"exceeds the context length of {self.max_model_len} tokens")
        if self.kv.full_kv_bytes(total) > self.kv.cfg.max_bytes:
            raise InvalidRequestError(f"prompt plus max_tokens ({total} tokens) does not fit the KV pool "
                                      f"of {self.kv.cfg.max_bytes} bytes")
        asked = self.config.kv_budget if kv_budget is None else kv_budget
        if not 0.0 < asked <= 1.0:
            raise InvalidRequestError(f"kv_budget must be in (0, 1], got {asked}", "kv_budget")
        # A prompt so short that the budget leaves less than one page per layer is served at one
        # page per layer, the least the cache can hold (its usage reports the ratio it got).
        budget = max(asked, 1.0 / math.ceil(len(ids) / self.kv.cfg.block_size))

        def refused(e: ValueError) -> InvalidRequestError:
            why = str(e)
            if budget != asked:
                why += (f" (the budget {asked:.4g} was raised to {budget:.4g}: one {self.kv.cfg.block_size}-token "
                        f"page per layer for this {len(ids)}-token prompt)")
            if kv_budget is None:
                why += (f"; the request sent no kv_budget, so the server's default kv_budget {asked:.4g} "
                        f"applies: send kv_budget, or raise the server's default")
            return InvalidRequestError(why, "kv_budget")
        try:
            self.policy.check(len(ids), budget, self.kv)
        except ValueError as e:
            raise refused(e) from None
        labels, floor, spec = None, 0.0, self.policy.spec
        if spec.needs_tags:
            labels = prompt_labels(self.tokenizer, ids)
            try:
                self.policy.check_prompt(labels, budget, self.kv)
            except ValueError as e:
                raise refused(e) from None
            floor = self.policy.prompt_floor(labels, self.kv)
        if spec.prompt_only:
            floor = 1.0  # compresses the prompt to a token count: a lower budget has nothing to act on
        matcher = self.grammar.matcher(grammar) if grammar is not None and compile_grammar else None
        seq = Sequence(request_id, ids, params, matcher=matcher, kv_budget=budget, requested_budget=budget,
                       floor_budget=floor,
                       generator=torch.Generator().manual_seed(params.seed) if params.seed is not None else None)
        seq.kv_budget = self._effective_budget(seq)
        seq.detokenizer = IncrementalDetokenizer(self._detokenize, self._token_bytes)
        if spec.needs_tags:
            seq.policy_state["tagger"] = _tagger_for(grammar)
            seq.policy_state["tags"] = {}   # position -> bucket of each tagged output token
            seq.policy_state["prompt_labels"] = labels
        self._seqs[request_id] = seq
        if grammar is None or compile_grammar:
            self.scheduler.add(seq)

    def grammar_ready(self, request_id: str, matcher) -> bool:
        """Schedule a request held by ``add_request(..., compile_grammar=False)`` with its
        compiled ``matcher``; False if it was aborted meanwhile."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        seq.matcher = matcher
        self.scheduler.add(seq)
        return True

    # ------------------------------------------------------------------ cluster control
    def _effective_budget(self, seq: Sequence) -> float:
        """The request's budget, lowered to the replica budget but never below the policy's floor
        for the prompt (floors are not broken: the controller's memory target is met by admitting
        fewer sequences instead)."""
        return min(seq.requested_budget, max(self.replica_budget, seq.floor_budget))

    def set_replica_budget(self, budget: float) -> None:
        """Cap every sequence's KV budget at ``budget`` (call between steps). In-flight sequences
        follow at their next step: PASK demotes above-floor cells, score policies release.

        Raises:
            ValueError: a budget outside (0, 1].
        """
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"replica budget must be in (0, 1], got {budget}")
        self.replica_budget = budget
        for seq in self._seqs.values():
            seq.kv_budget = self._effective_budget(seq)

    @property
    def floor_budget(self) -> float:
        """The lowest budget worth asking of this replica: the policy's calibrated floor cost
        (0 for policies without floors; 1 for policies that compress the prompt only)."""
        if self.policy.spec.prompt_only:
            return 1.0
        return float(self.policy.floor_cost)

    def load_table(self, kind: str, folder: str | Path, version: str) -> None:
        """Validate the table artifact at ``folder`` against the served model and swap it into the
        policy (call between steps). Sequences in flight finish on the table they started with.

        Raises:
            calibration.artifacts.ArtifactError: missing, corrupted, wrong model or wrong shapes.
            ValueError: the policy has no table of this kind.
        """
        if kind not in self.policy.spec.table_kinds:
            raise ValueError(f"the replica's KV policy {self.policy.name!r} has no {kind!r} table")
        self.policy.swap_table(folder, resolve_checkpoint(self.config.model))
        self.table_versions[kind] = version
        if self.kv.prefix is not None:   # KV computed under the old table is not reused
            self.kv.prefix.set_key(self._prefix_key())

    def _prefix_key(self) -> tuple:
        """What a cached prefix's KV depends on besides its tokens (the prefix cache's key)."""
        c = self.config
        return (str(resolve_checkpoint(c.model)), c.kv_policy, sorted(c.kv_policy_args.items()), str(self.kv.cfg.dtype),
                c.block_size, sorted(self.table_versions.items()))

    def stats(self) -> dict:
        """What the budget controller reads: KV bytes held and allowed, queue and batch sizes,
        the replica budget and its floor. With prefix caching, ``kv_bytes_used`` counts a shared
        prefix once and leaves out cached pages no sequence references (evictable:
        ``kv_bytes_prefix_cached``); ``prefix_cache_queries`` / ``prefix_cache_hits`` are prompt
        tokens looked up and found cached (vLLM's metrics of the same names)."""
        prefix = self.kv.prefix
        idle = prefix.idle_bytes if prefix is not None else 0
        return {"kv_bytes_used": self.kv.bytes_used - idle, "kv_bytes_max": self.kv.cfg.max_bytes,
                "num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
                "budget": self.replica_budget, "floor": self.floor_budget,
                "kv_bytes_prefix_cached": idle,
                "prefix_cache_queries": prefix.queries if prefix is not None else 0,
                "prefix_cache_hits": prefix.hits if prefix is not None else 0,
                "prefix_cache_compressed_hits": prefix.compressed_hits if prefix is not None else 0,
                "prefix_cache_unshared_pages": self.kv.blocks.num_unshared_pages}

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV cache; None if it is not in flight."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        return RequestOutput.of(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one step (prompt chunks, decode, or with chunked prefill both in one forward);
        return the outputs of the sequences it advanced (for prompts: those it completed)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        seqs, logits, drawn, lengths = self._forward(sched.decode, sched.prefill)
        if not seqs:
            return []
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw = torch.log_softmax(logits[want], dim=-1) if want else None  # before mask and temperature
        rest = [i for i in range(len(seqs)) if i not in drawn]   # drawn: a draft's rejection drew it
        if len(rest) < len(seqs):
            tokens = [drawn.get(i) for i in range(len(seqs))]
            if rest:
                sub = logits[rest]
                self.grammar_mask(sub, [seqs[i] for i in rest])
                for i, t in zip(rest, sample(sub, [seqs[i] for i in rest], self.generator)):
                    tokens[i] = t
        else:
            self.grammar_mask(logits, seqs)
            tokens = sample(logits, seqs, self.generator)
        for row, i in enumerate(want):
            self._record_logprob(seqs[i], raw[row], tokens[i])
        kv = self.kv   # KV bytes each holds and full KV's bytes, for the batch at once
        rows = kv.seqs   # (-1: preempted in this step, holds none)
        idx = [rows.get(s.request_id, -1) for s in seqs]
        held = kv.blocks.views.row_bytes[idx].tolist()
        if -1 in idx:
            held = [None if i < 0 else h for i, h in zip(idx, held)]
        full = kv.full_kv_bytes_batch(lengths).tolist()
        return [self._postprocess(*a) for a in zip(seqs, tokens, held, full, lengths)]

    @staticmethod
    def _record_logprob(seq: Sequence, logprobs: torch.Tensor, token: int) -> None:
        """Keep the sampled token's log-probability and the top ``params.logprobs`` alternatives
        from ``logprobs [vocab]`` (a -inf is reported as -9999.0, as vLLM does: JSON has no -inf)."""
        k = seq.params.logprobs
        values, ids = logprobs.topk(k) if k else (logprobs[:0], logprobs[:0].long())
        finite = lambda x: x if x > -9999.0 else -9999.0  # noqa: E731
        top = tuple((int(i), finite(float(v))) for i, v in zip(ids.tolist(), values.tolist()))
        if seq.logprobs is None:
            seq.logprobs = []
        seq.logprobs.append(TokenLogprob(token, finite(float(logprobs[token])), top))

    def _forward(self, decode: list[Sequence], work: list[PrefillWork]
                 ) -> tuple[list[Sequence], torch.Tensor | None, dict[int, int], list[int]]:
        """One forward over the step's decode batch and prompt chunks; returns the sequences to
        sample (the decode batch, then the prompts completed in this step), their logits
        ``[n, vocab]`` (None when there are none), by index into them the tokens already drawn
        (a jump-forward draft verified in this step: the token the model sampled instead of a
        draft token, ``_verify_draft``), and their token counts (``num_tokens``, read once).

        Decode: the policy picks each new token's precision per layer, the cache places the
        batch (one plan), the policy's evictions are applied in one batched release. Prompts: a
        prompt's policy targets are fixed at its first chunk; its window queries (and, for the
        window perplexity, its last hidden states) are carried over chunks; when its last chunk
        is in, the policy compresses it (``on_prefill``). Then the budget is checked for every
        sequence sampled, at once."""
        spec, kv = self.policy.spec, self.kv
        jumps = [s for s in decode if s.draft_token_ids]   # fed as a chunk: last sampled token + draft
        if jumps:
            decode = [s for s in decode if not s.draft_token_ids]
        plan = None
        if decode:
            lengths = [s.num_tokens for s in decode]
            targets = self.policy.decode_targets(decode, kv, lengths)
            positions = torch.tensor(lengths, dtype=torch.int64).sub_(1)
            plan = kv.plan_decode([s.request_id for s in decode], positions, targets)
        w = spec.observation_window
        keep_hidden = min(w, self.max_model_len) + 1 if spec.wants_window_ppl and w else 0
        chunks, copies = [], []
        for item in work:
            seq = item.seq
            shadow = kv.shadow_of(seq.request_id)
            if seq.prefill_state is None:   # its first chunk (after a cached prefix, if any)
                self._drop_draft(seq)   # (preempted with one: the recompute samples again)
                seq.prefill_state = {"targets": self.policy.prefill_targets(seq, kv), "queries": {}, "hidden": None}
                if shadow is not None and item.start:   # a hit: its own copy of the prefix, at its targets
                    copies.append((seq.request_id, item.start, seq.prefill_state["targets"]))
            targets = seq.prefill_state["targets"]
            chunks.append(PrefillChunk(seq.request_id, seq.all_token_ids[item.start:item.end], item.start,
                                       None if targets is None else targets[item.start:item.end], item.is_last,
                                       shadow))
        for seq in jumps:
            n, k = seq.num_tokens, len(seq.draft_token_ids)
            chunks.append(PrefillChunk(seq.request_id, [seq.all_token_ids[-1], *seq.draft_token_ids], n - 1,
                                       self._forced_targets(seq, n - 1, n + k), True, draft=True))
        try:
            for rid, n, targets in copies:
                kv.copy_prefix(rid, n, targets)
            logits, queries, results = self.runner.forward(decode, plan, chunks, spec.record_decode_queries,
                                                           w, keep_hidden)
        except KVCacheOutOfMemory:   # the pool filled mid-forward: the step's sequences recompute later
            for seq in decode + jumps + [item.seq for item in work]:
                self.scheduler.preempt(seq)
            return [], None, {}, []
        if kv.prefix is not None:   # every layer of these chunks is written: their full pages can be shared
            for item in work:
                kv.cache_prefix(item.seq.request_id, item.seq.all_token_ids, item.end)
        done, rows = list(decode), [logits] if decode else []
        if decode:
            ev = self.policy.decode_evictions(decode, kv, plan.rows, queries, plan.positions)
            if ev is not None:
                if ev.rows.numel():
                    kv.release_one(ev.rows, ev.layers, ev.positions)
                for seq, a in ev.actions:
                    kv.set_precision(seq.request_id, a.layer, a.positions, a.precision)
        drawn = {}
        for seq, res in zip(jumps, results[len(work):]):
            row, token = self._verify_draft(seq, res.logits)
            if token is not None:
                drawn[len(done)] = token
            done.append(seq)
            rows.append(row[None])
        for item, res in zip(work, results[:len(work)]):
            seq, state = item.seq, item.seq.prefill_state
            seq.num_computed_tokens = item.end
            for layer, q in res.queries.items():
                prev = state["queries"].get(layer)
                state["queries"][layer] = q if prev is None else torch.cat([prev, q])[-w:]
            if keep_hidden:
                prev = state["hidden"]
                state["hidden"] = res.hidden if prev is None else torch.cat([prev, res.hidden])[-keep_hidden:]
            if not item.is_last:
                if spec.compresses_chunks:   # the prompt so far, to what its end will keep
                    view = PrefillView(seq, kv, item.end, {}, seq.kv_budget)
                    for a in self.policy.on_prefill_chunk(view):
                        kv.set_precision(seq.request_id, a.layer, a.positions, a.precision)
                continue
            n = seq.num_tokens
            ppl = None
            if keep_hidden and n > 1:
                k = min(w, n - 1)
                ppl = self.runner.window_ppl(state["hidden"][-k - 1:], seq.all_token_ids[-k:])
            seq.prefilled, seq.prefill_state = True, None
            kv.drop_shadow(seq.request_id)
            view = PrefillView(seq, kv, n, state["queries"], seq.kv_budget, ppl)
            try:
                for a in self.policy.on_prefill(view):
                    kv.set_precision(seq.request_id, a.layer, a.positions, a.precision)
            except KVCacheOutOfMemory:
                self.scheduler.preempt(seq)
                continue
            done.append(seq)
            rows.append(res.logits[None])
        if not done:
            return [], None, {}, []
        lengths = (lengths if decode else []) + [s.num_tokens for s in done[len(decode):]]
        self._enforce_budget(done, lengths)
        logits = torch.cat(rows)
        row_of = kv.seqs
        kept = [i for i, s in enumerate(done) if s.request_id in row_of]   # not preempted by it
        if len(kept) < len(done):
            drawn = {j: drawn[i] for j, i in enumerate(kept) if i in drawn}
            return [done[i] for i in kept], (logits[kept] if kept else None), drawn, [lengths[i] for i in kept]
        return done, logits, drawn, lengths

    def _forced_targets(self, seq: Sequence, start: int, end: int) -> torch.Tensor | None:
        """``[end - start, L]`` int64 Precision of ``seq``'s tokens at positions ``start .. end - 1``
        (its last sampled token and the forced ones after it), each what the policy's
        ``decode_targets`` gives it in a decode step of its own (PASK: from the token's tag); None:
        all HIGH."""
        rows = [self.policy.decode_targets([_AtLength(seq, p + 1)], self.kv) for p in range(start, end)]
        if all(r is None for r in rows):
            return None
        high = torch.full((self.kv.cfg.num_layers,), int(Precision.HIGH), dtype=torch.int64)
        return torch.stack([high if r is None else r[0] for r in rows])

    def _enforce_budget(self, seqs: list[Sequence], lengths: list[int]) -> None:
        """The engine's guarantee, owned here: bytes held <= budget x full-KV bytes after every
        step. One comparison for the batch; a sequence over it is brought back by its policy
        (``hold_budget``: PASK demotes its table state), then, if still over, has its oldest
        entries released (counted in ``metrics.budget_fallbacks``; the baselines and PASK never
        need it). A demotion that needs a LOW page the pool cannot give preempts the sequence
        (recomputed later, its sampled tokens kept)."""
        budgets = [s.kv_budget for s in seqs]
        if not seqs or min(budgets) >= 1.0:   # full KV: nothing to hold
            return
        kv = self.kv
        row_of = kv.seqs
        rows = [row_of[s.request_id] for s in seqs]
        budgets = np.asarray(budgets, dtype=np.float64)   # (NumPy: 0.14-0.20 -> 0.05-0.08 ms a step)
        allowed = budgets * kv.full_kv_bytes_batch(lengths)
        over = (budgets < 1.0) & (kv.blocks.views.row_bytes[rows] > allowed + 1e-6)
        for i in over.nonzero()[0].tolist():
            seq = seqs[i]
            try:
                self.policy.hold_budget(seq, kv, seq.kv_budget)
                self._hold_to_budget(seq)
            except KVCacheOutOfMemory:
                self.scheduler.preempt(seq)

    def _hold_to_budget(self, seq: Sequence) -> None:
        """Release the oldest entries of the layers holding most until ``seq`` meets its budget."""
        kv, rid = self.kv, seq.request_id
        allowed = seq.kv_budget * kv.full_kv_bytes(seq.num_tokens)
        if kv.sequence_bytes(rid) <= allowed + 1e-6:
            return
        seq.metrics.budget_fallbacks += 1
        layers = range(kv.cfg.num_layers)
        while kv.sequence_bytes(rid) > allowed + 1e-6:
            layer = max(layers, key=lambda l: kv.num_kept(rid, l))
            kept = kv.kept_positions(rid, layer)
            oldest = kept[kept >= kv.shared_tokens(rid)][: kv.cfg.block_size]   # shared pages are read-only
            if not oldest.numel():
                break
            kv.set_precision(rid, layer, oldest, Precision.RELEASED)

    def grammar_mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        if any([s.matcher is not None for s in seqs]):   # (a list: one call, not one per row)
            self.grammar.apply_bitmask(logits, [s.matcher for s in seqs])

    def _postprocess(self, seq: Sequence, token: int, held: int | None, full: int, n: int) -> RequestOutput:
        """Append the sampled ``token`` to ``seq`` (``n`` tokens before it), which holds ``held``
        KV bytes after the step (None: preempted in it) where full KV would hold ``full``; check
        its stop conditions and return its output."""
        m = seq.metrics
        m.first_token_s = m.first_token_s or time.monotonic()
        if held is not None:
            if held > m.kv_bytes_peak:
                m.kv_bytes_peak = held
            ratio = held / full
            m.kv_ratio_sum, m.num_steps = m.kv_ratio_sum + ratio, m.num_steps + 1
            if ratio > m.kv_ratio_max:
                m.kv_ratio_max = ratio
        seq.output_token_ids.append(token)
        n += 1
        state = seq.policy_state   # (membership and indexing: no call for policies without tags)
        tagger = state["tagger"] if "tagger" in state else None
        if tagger is not None:  # PASK: the token's structural bucket, used when its KV is stored
            state["tags"][n - 1] = tagger.feed_bucket(self._token_text[token])
        p = seq.params
        if seq.matcher is not None and not seq.matcher.is_terminated():
            seq.matcher.accept_token(token)
        stop_token = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        searched = len(seq.text) if p.stop else 0
        if not stop_token or (p.include_stop_str_in_output and token in p.stop_token_ids):
            seq.text += seq.detokenizer.add(token)   # a stop token is not part of the text unless asked for (vLLM)
        # Only where a stop string could end in the new text (the text before was searched).
        hits = [(i, len(s)) for i, s in ((seq.text.find(s, max(0, searched - len(s) + 1)), s) for s in p.stop)
                if i >= 0] if p.stop and len(seq.text) > searched else []
        if hits:
            at, length = min(hits)
            seq.text = seq.text[: at + length if p.include_stop_str_in_output else at]
            self._finish(seq, "stop")
            return RequestOutput.of(seq)
        reason = None
        if stop_token or (seq.matcher is not None and seq.matcher.is_terminated()):
            reason = "stop"
        elif n - seq.num_prompt_tokens >= p.max_tokens or n >= self.max_model_len:   # n - prompt: outputs
            reason = "length"
        if reason:
            seq.text = seq.detokenizer.flush()   # with a character cut off by the end, if any
            self._finish(seq, reason)
        elif self.jump_forward and seq.matcher is not None:
            self._jump_forward(seq)
        return RequestOutput.of(seq)

    def _jump_forward(self, seq: Sequence) -> None:
        """Draft the tokens ``seq``'s grammar forces after its last sampled token
        (``replicas/jump_forward.py``); the next step feeds them as one chunk and
        :meth:`_verify_draft` keeps those the model samples itself. Not for requests with
        logprobs, stop strings or stop token ids; at least one token of ``max_tokens`` and of the
        context is left to sample. The matcher is left where it was (the draft is accepted again
        token by token as it is verified); the draft's tags (PASK: the precisions its KV is
        stored at) come from a copy of the tagger."""
        p = seq.params
        if p.logprobs is not None or p.stop or p.stop_token_ids:
            return
        room = min(p.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
        ids = forced_tokens(seq.matcher, lambda text: self._forced_tokenizer(seq.output_token_ids, text), room)
        if not ids:
            return
        seq.matcher.rollback(len(ids))
        tagger = seq.policy_state.get("tagger")
        if tagger is not None:
            draft_tagger, tags = tagger.copy(), seq.policy_state.setdefault("tags", {})
            for i, token in enumerate(ids):
                tags[seq.num_tokens + i] = draft_tagger.feed_bucket(self._token_text[token])
        seq.draft_token_ids = ids
        seq.metrics.num_draft_tokens += len(ids)

    def _verify_draft(self, seq: Sequence, logits: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """Keep the draft tokens the model samples itself, as speculative decoding verifies a
        draft (Leviathan et al., 2023, with a draft that puts all its mass on one token: accept
        it with the model's probability of it).

        ``logits [k + 1, vocab]``: the model's logits after the last sampled token and after each
        of the ``k`` draft tokens (one chunk). In order, each draft position is sampled as a
        decode step would sample it (grammar mask, penalties, temperature, the request's
        generator): a draw equal to the draft token appends it without a step of its own
        (``metrics.num_forced_tokens``); the first draw that differs is the sequence's next
        token, and the KV of the draft from there on is taken back (``KVCache.truncate``). So
        every output token is drawn from the model's own distribution after the tokens before
        it; greedy outputs are the tokens of decoding one step per token (up to the float
        rounding of one chunk against single-token steps). Returns the logits row of the next
        token ``[vocab]`` and that token if drawn here (None: all ``k`` kept, sample the row)."""
        draft, seq.draft_token_ids = seq.draft_token_ids, []
        start = seq.num_tokens   # the draft's first position
        for i, token in enumerate(draft):
            row = logits[i:i + 1].clone()
            self.grammar_mask(row, [seq])
            drawn = sample(row, [seq], self.generator)[0]
            if drawn != token:
                self.kv.truncate(seq.request_id, start + i)
                self._drop_draft(seq, draft[i:], start + i)
                return logits[i], drawn
            self._accept_forced(seq, token)
        return logits[len(draft)], None

    def _accept_forced(self, seq: Sequence, token: int) -> None:
        """Append a verified draft token: what :meth:`_postprocess` does for a sampled one, without
        the stop checks (a draft holds no stop token and leaves room before ``max_tokens``)."""
        seq.output_token_ids.append(token)
        tagger = seq.policy_state.get("tagger")
        if tagger is not None:
            seq.policy_state.setdefault("tags", {})[seq.num_tokens - 1] = tagger.feed_bucket(self._token_text[token])
        if not seq.matcher.accept_token(token):
            raise RuntimeError(f"request {seq.request_id!r}: its grammar refused draft token {token}")
        seq.text += seq.detokenizer.add(token)
        seq.metrics.num_forced_tokens += 1

    @staticmethod
    def _drop_draft(seq: Sequence, draft: list[int] | None = None, start: int | None = None) -> None:
        """Forget a draft (or its tail ``draft`` from position ``start``): its tokens and tags."""
        if draft is None:
            draft, start, seq.draft_token_ids = seq.draft_token_ids, seq.num_tokens, []
        tags = seq.policy_state.get("tags")
        if tags:
            for p in range(start, start + len(draft)):
                tags.pop(p, None)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.metrics.finished_s = time.monotonic()
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)

    # ------------------------------------------------------------------ convenience
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None,
                 grammars: list[GrammarSpec | None] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion (batched) and return their final outputs in order."""
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            self.add_request(rid, prompt, params, grammars[i] if grammars else None)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in ids]
