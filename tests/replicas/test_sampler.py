"""Sampling: penalties, top-k, top-p, min-p on hand-built logits; bad values refused."""

import pytest
import torch

from replicas.errors import InvalidRequestError
from replicas.sampler import apply_penalties, sample
from replicas.sampling_params import SamplingParams
from replicas.sequence import Sequence


def seq(prompt=(0,), output=(), **params):
    s = Sequence("s", list(prompt), SamplingParams(**params))
    s.output_token_ids = list(output)
    return s


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -1.0, 3.0, 0.5])
    apply_penalties(logits, seq(prompt=[0], output=[1], repetition_penalty=2.0))
    assert logits.tolist() == [1.0, -2.0, 3.0, 0.5]   # 0 (prompt) and 1 (output) penalized only


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(4)
    apply_penalties(logits, seq(prompt=[3], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25))
    assert logits.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_greedy_rows_see_penalties():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    assert sample(logits.clone(), [seq(output=[0, 0], frequency_penalty=1.0)], torch.Generator()) == [1]
    assert sample(logits.clone(), [seq(output=[0, 0])], torch.Generator()) == [0]


def draws(logits, n=400, **params):
    g = torch.Generator().manual_seed(0)
    return {sample(logits.clone()[None], [seq(temperature=1.0, **params)], g)[0] for _ in range(n)}


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert draws(logits) == {0, 1, 2, 3}
    assert draws(logits, top_k=2) == {0, 1}
    assert draws(logits, top_k=-1) == {0, 1, 2, 3}
    assert draws(logits, top_p=0.65) == {0, 1}          # 0.4 + 0.3 reaches 0.65
    assert draws(logits, min_p=0.6) == {0, 1}           # 0.2 < 0.6 * 0.4
    assert draws(logits, top_k=3, top_p=0.5) == {0, 1}  # top-p over the renormalized top 3


@pytest.mark.parametrize("kw", [dict(top_k=-2), dict(min_p=1.5), dict(repetition_penalty=0.0),
                                dict(presence_penalty=2.5), dict(frequency_penalty=-3.0)])
def test_bad_values_are_refused(kw):
    with pytest.raises(InvalidRequestError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_logit_bias_is_added_first():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    assert sample(logits.clone(), [seq(logit_bias={2: 100.0})], torch.Generator()) == [2]
    assert sample(logits.clone(), [seq(logit_bias=((0, -100.0),))], torch.Generator()) == [1]
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def test_penalties_never_unmask_what_the_grammar_masked():
    """Found by a new-user trial: repetition_penalty 1e-50 (0 in float32) turned the grammar's
    -inf into NaN (-inf * 0), argmax took it, and the output broke the grammar."""
    logits = torch.tensor([[float("-inf"), 2.0, float("-inf"), -1.0]])
    s = seq(prompt=[0, 2, 3], output=[0], repetition_penalty=0.01, frequency_penalty=-2.0, logit_bias={0: 100.0})
    object.__setattr__(s.params, "repetition_penalty", 1e-50)  # below the API's range, as if it slipped through
    assert sample(logits, [s], torch.Generator()) == [1]
    assert torch.isneginf(logits[0, [0, 2]]).all()
    with pytest.raises(InvalidRequestError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-50)
