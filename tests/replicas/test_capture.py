"""The decode forward over a step plan is capturable: one graph, no break, same logits as eager."""

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.kv_cache import Precision
from replicas.sampling_params import SamplingParams


@pytest.fixture
def decoding(micro_model):
    """An engine on the micro model with three sequences decoding, their KV in all three pools."""
    eng = LLMEngine(EngineConfig(model=str(micro_model), kv_cache_bytes=16 << 20, max_num_seqs=4,
                                 max_model_len=512))
    for i, n in enumerate((37, 20, 53)):
        eng.add_request(f"r{i}", list(range(5, 5 + n)), SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(3):
        eng.step()
    for s in eng.scheduler.running:
        eng.kv.set_precision(s.request_id, 0, range(2, 12), Precision.INT8)
        eng.kv.set_precision(s.request_id, 1, range(4, 9), Precision.INT4)
    yield eng
    eng.close()


def _forward(eng, plan, model=None):
    """The decode forward over ``plan``: store the new KV, attend, logits ``[B, vocab]``."""
    kv, model = eng.kv, model or eng.model

    def forward(ids, positions):
        def attention(layer, q, k, v):
            kv.store(plan, layer, k, v)
            return kv.attend(plan, layer, q, k, v)
        return model.logits(model(ids, positions, attention))
    return forward


def _plan(eng, targets, seqs=None, advance=0):
    """A decode plan over ``seqs`` (default: every running sequence) with the new tokens'
    ``targets [B, L]`` precisions, at each sequence's last position plus ``advance``; returns
    ``(plan, ids, positions)``."""
    seqs = list(eng.scheduler.running) if seqs is None else seqs
    positions = torch.tensor([s.num_tokens - 1 + advance for s in seqs])
    plan = eng.kv.plan_decode([s.request_id for s in seqs], positions, torch.tensor([[int(p) for p in row] for row in targets]))
    return plan, torch.tensor([s.output_token_ids[-1] for s in seqs]), positions


def test_decode_forward_compiles_fullgraph_and_equals_eager(decoding):
    eng = decoding
    H, I8, I4 = Precision.HIGH, Precision.INT8, Precision.INT4
    # New tokens at every precision, one not stored at all (it still attends to itself).
    plan, ids, positions = _plan(eng, [[H, I8], [I4, H], [Precision.RELEASED, I8]])
    plan.capturable = True
    forward = _forward(eng, plan)    # stores the same values each call: idempotent
    with torch.no_grad():
        eager = forward(ids, positions)
        torch._dynamo.reset()
        compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")(ids, positions)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    plan.capturable = False   # the chunked eager reference gives the same logits
    with torch.no_grad():
        torch.testing.assert_close(forward(ids, positions), eager, rtol=1e-4, atol=1e-4)


def _compiled_code(eng, plan, ids, positions):
    """Inductor's generated code for the decode forward over ``plan``, and its logits."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    with torch.no_grad():
        return run_and_get_code(torch.compile(_forward(eng, plan), fullgraph=True, backend="inductor"), ids, positions)


def test_inductor_writes_the_pools_in_place(decoding):
    """Compiled by inductor, the step's KV writes touch only the new slots: no kernel of the
    generated code spans a whole pool (a write through a view of a pool is functionalized into a
    copy of every pool on every call: ``kernels.kv_store``). The values written and the logits
    equal eager's."""
    eng = decoding
    H, I8, I4 = Precision.HIGH, Precision.INT8, Precision.INT4
    plan, ids, positions = _plan(eng, [[H, I8], [I4, H], [I8, I8]])
    pools = [eng.kv.pools[p] for p in (Precision.HIGH, Precision.INT8, Precision.INT4)]

    def written():
        return [t.flatten(0, 1)[plan.slot_mapping[p.precision][layer]].clone()
                for p in pools for t in p.tensors() for layer in range(eng.kv.cfg.num_layers)]

    plan.capturable = True
    with torch.no_grad():
        eager = _forward(eng, plan)(ids, positions)
    eager_written = written()
    for p in pools:   # so that the compiled call has to write them again
        for t in p.tensors():
            for layer in range(eng.kv.cfg.num_layers):
                t.flatten(0, 1)[plan.slot_mapping[p.precision][layer]] = 0
    compiled, codes = _compiled_code(eng, plan, ids, positions)
    code = "\n".join(codes)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(written(), eager_written):
        torch.testing.assert_close(got, want)
    # a kernel over a whole pool loops to the pool's numel (C++: ``x0<static_cast<int64_t>(N L)``)
    bounds = {f"<static_cast<int64_t>({t.numel()}L)" for p in pools for t in p.tensors()}
    spans = [line.strip() for line in code.splitlines() if any(b in line for b in bounds)]
    assert not spans, spans[:3]


def test_decode_graph_equals_eager_over_every_pool(decoding):
    """The engine's compiled decode forward (``DecodeGraph``, one dynamic-shape graph) gives the
    eager forward's logits and writes the same values at the plan's slots, with the new tokens
    stored at HIGH, INT8, INT4 and not at all in different rows and layers; the batch is padded
    (to 2 rows for one sequence) without writing outside the trash page."""
    from replicas.decode_graph import DecodeGraph
    eng = decoding
    graph = DecodeGraph(eng.model, eng.kv, (Precision.HIGH, Precision.INT8, Precision.INT4), 4)
    seqs = list(eng.scheduler.running)
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]   # (the counters are the process's)
    for batch, targets in ((seqs, [[int(Precision.HIGH), int(Precision.INT8)], [int(Precision.INT4), int(Precision.RELEASED)],
                                   [int(Precision.INT8), int(Precision.INT8)]]),
                           (seqs[:1], [[int(Precision.INT4), int(Precision.HIGH)]])):
        plan, ids, positions = _plan(eng, targets, batch, advance=1)   # a new position: placed now
        assert graph.supports(plan)
        with torch.no_grad():
            eager = _forward(eng, plan)(ids, positions)
            pools = {p: [t.clone() for t in eng.kv.pools[p].tensors()] for p in graph.precisions}
            for p, mapping in plan.slot_mapping.items():   # the graph has to write the new slots again
                for t in eng.kv.pools[p].tensors():
                    t.flatten(0, 1)[mapping.flatten()] = 0
            got, queries = graph(ids, positions, plan)
            assert queries == {}
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        for p in graph.precisions:   # equal everywhere but the trash page (padding rows write there)
            for t, want in zip(eng.kv.pools[p].tensors(), pools[p]):
                torch.testing.assert_close(t[1:], want[1:], equal_nan=True)   # (pages never handed out)
        for s in batch:
            s.output_token_ids.append(int(got[batch.index(s)].argmax()))
    assert graph.calls == 2 and not graph.failed
    assert counters["stats"]["unique_graphs"] - graphs_before == 1, dict(counters["stats"])   # one compile for both batches


def test_each_decode_graph_computes_with_its_own_models_weights(decoding, micro_model):
    """On the CPU the graph freezes the weights into constants (prepacked for oneDNN), so a
    second engine's graph, over a model of the same shapes with other weights, compiles again and
    must not reuse the first's. Each graph compiles its own code object
    (``decode_graph._own_code``): engines in one process do not share TorchDynamo's recompile
    budget per code object (1 here, 8 by default; over it, with ``fullgraph``, it raises)."""
    from replicas.decode_graph import DecodeGraph
    from replicas.models import load_model
    from replicas.models.llama import prepack_linears
    eng = decoding
    other = load_model(micro_model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.25)
    prepack_linears(other)
    H = int(Precision.HIGH)
    plan, ids, positions = _plan(eng, [[H, H]] * 3)   # (each forward writes its own new KV first)
    for model in (eng.model, other):
        graph = DecodeGraph(model, eng.kv, (Precision.HIGH, Precision.INT8, Precision.INT4), 4)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
            eager = _forward(eng, plan, model)(ids, positions)
            out = graph(ids, positions, plan)
        assert out is not None and graph.calls == 1 and not graph.failed
        got, _ = out
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert not torch.allclose(_forward(eng, plan)(ids, positions), eager, atol=1e-3)


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_engine_with_compiled_decode_matches_eager(micro_model, policy):
    """``enforce_eager=False``: every decode step runs through the graph, and greedy outputs
    equal the eager engine's; H2O, which reads each step's queries, gets them from the graph."""
    outs, observed = {}, {}
    for eager in (True, False):
        eng = LLMEngine(EngineConfig(model=str(micro_model), kv_cache_bytes=16 << 20, max_num_seqs=4,
                                     max_model_len=256, enforce_eager=eager, kv_policy=policy,
                                     kv_budget=1.0 if policy == "full" else 0.5))
        if policy == "h2o":   # the queries H2O scores with, per step: their layers and values
            seen, observe = observed.setdefault(eager, []), eng.policy.observe_decode_batch
            eng.policy.observe_decode_batch = lambda seqs, kv, rows, positions, queries: (
                seen.append({k: q.clone() for k, q in queries.items()}), observe(seqs, kv, rows, positions, queries))
        res = eng.generate([list(range(5, 5 + n)) for n in (37, 20, 53)],
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        outs[eager] = [list(r.token_ids) for r in res]
        if not eager:
            assert eng.runner.graph.calls == 11 and not eng.runner.graph.failed   # 12 tokens: 1 from prefill
        eng.close()
    assert outs[False] == outs[True]
    if policy == "h2o":
        assert len(observed[False]) == len(observed[True]) == 11
        for got, want in zip(observed[False], observed[True]):
            assert sorted(got) == sorted(want) == list(range(eng.kv.cfg.num_layers))
            for layer in want:
                torch.testing.assert_close(got[layer], want[layer], rtol=1e-4, atol=1e-4)


def test_enforce_eager_false_needs_one_rank():
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(enforce_eager=False, tensor_parallel_size=2)
