"""The decode forward over a step plan is capturable: one graph, no break, same logits as eager."""

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.kv_cache import Precision
from replicas.sampling_params import SamplingParams


@pytest.fixture(scope="module")
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


def test_decode_forward_compiles_fullgraph_and_equals_eager(decoding):
    eng = decoding
    seqs = list(eng.scheduler.running)
    positions = torch.tensor([s.num_tokens - 1 for s in seqs])
    # New tokens at every precision, one not stored at all (it still attends to itself).
    targets = torch.tensor([[int(Precision.HIGH), int(Precision.INT8)], [int(Precision.INT4), int(Precision.HIGH)],
                            [int(Precision.RELEASED), int(Precision.INT8)]])
    plan = eng.kv.plan_decode([s.request_id for s in seqs], positions, targets)
    plan.capturable = True
    ids = torch.tensor([s.output_token_ids[-1] for s in seqs])
    kv, model = eng.kv, eng.model

    def forward(ids, positions):
        def attention(layer, q, k, v):
            kv.store(plan, layer, k, v)           # the same values twice: idempotent
            return kv.attend(plan, layer, q, k, v)
        return model.logits(model(ids, positions, attention))

    with torch.no_grad():
        eager = forward(ids, positions)
        torch._dynamo.reset()
        compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")(ids, positions)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    plan.capturable = False   # the chunked eager reference gives the same logits
    with torch.no_grad():
        torch.testing.assert_close(forward(ids, positions), eager, rtol=1e-4, atol=1e-4)
