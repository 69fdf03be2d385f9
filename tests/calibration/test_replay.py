"""Teacher-forced replay under a precision map reproduces what the engine computed."""

import torch

from calibration.replay import compressed_forward, continuation_nll
from replicas.kv_cache import Precision
from replicas.policies import PASKPolicy, PASKTable
from replicas.policies.pask import SideTable
from replicas.prompt_labels import NUM_PROMPT_BUCKETS, PROMPT_BUCKETS
from replicas.sampling_params import SamplingParams
from replicas.tagger import BUCKETS, NUM_BUCKETS


def test_replay_matches_engine_greedy_tokens_under_compression(engine, chat_prompts):
    groups = [(0, 2), (2, 4), (4, 6)]
    dec = torch.full((NUM_BUCKETS, 3), int(Precision.HIGH))
    dec[BUCKETS.index("whitespace")] = int(Precision.RELEASED)
    dec[BUCKETS.index("free_text"), 1:] = int(Precision.INT4)
    dec[BUCKETS.index("punctuation")] = int(Precision.INT8)
    pro = torch.full((NUM_PROMPT_BUCKETS, 3), int(Precision.INT8))
    pro[PROMPT_BUCKETS.index("description")] = int(Precision.RELEASED)
    pro[PROMPT_BUCKETS.index("system_text"), 0] = int(Precision.INT4)
    empty = torch.empty(0, 2, dtype=torch.long)
    table = PASKTable(SideTable(dec, empty, torch.zeros(1)), SideTable(pro, empty, torch.zeros(1)), groups)
    saved, engine.policy = engine.policy, PASKPolicy(table)
    prompt = chat_prompts[3]
    try:
        engine.add_request("replay", prompt, SamplingParams(max_tokens=12, ignore_eos=True), kv_budget=1.0)
        seq = engine._seqs["replay"]
        while not seq.is_finished:
            engine.step()
    finally:
        engine.policy = saved
    out = seq.output_token_ids
    n, p = len(prompt) + len(out), len(prompt)
    buckets = seq.policy_state["prompt_labels"] + [seq.policy_state["tags"][i] for i in range(p, n)]
    group_of = table.group_of_layer()
    prec = torch.tensor([[int((pro if i < p else dec)[buckets[i], group_of[l]]) for i in range(n)] for l in range(6)])
    ids = torch.tensor(prompt + out)
    logits, outs = compressed_forward(engine.model, ids, p, prec, capture=True)
    assert logits[p - 1:-1].argmax(-1).tolist() == out
    full, base = compressed_forward(engine.model, ids, p, None, capture=True)
    assert len(outs) == 6 and outs[0].shape[0] == len(out)
    assert not torch.allclose(logits[p:], full[p:])          # the map did change the computation
    assert torch.allclose(logits[:p], full[:p])              # prefill never sees compressed KV
    assert continuation_nll(logits, ids, p) != continuation_nll(full, ids, p)
