"""Per-request sampling: truncation sets, greedy rows, seeds, log-probs under the temperature, validation."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.plugins.engines.local.sampling import SamplingError, parse_sampling, parse_sampling_rows, sample_tokens

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def draws(params: dict, n: int = 400) -> set[int]:
    p = parse_sampling(params)
    tokens, _ = sample_tokens(LOGITS.repeat(n, 1), [p] * n)
    return set(tokens.tolist())


@pytest.mark.parametrize("params, allowed", [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.4}, {0}),           # token 0 alone covers 0.4
    ({"top_p": 0.7}, {0, 1}),        # 0.5 + 0.3 covers 0.7
    ({"min_p": 0.5}, {0, 1}),        # p >= 0.25
    ({"top_k": 1}, {0}),             # greedy
    ({"temperature": 0}, {0}),
    ({}, {0, 1, 2, 3}),
])
def test_truncation_sets(params, allowed):
    torch.manual_seed(0)
    assert draws(params) == allowed


def test_rows_use_their_own_parameters_and_logprobs_follow_the_temperature():
    params = [parse_sampling({"temperature": 0}), parse_sampling({"temperature": 2.0, "top_k": 1}),
              parse_sampling({"temperature": 0.5})]
    tokens, logprobs = sample_tokens(LOGITS.repeat(3, 1), params)
    assert tokens[:2].tolist() == [0, 0]
    assert math.isclose(logprobs[0].item(), math.log(0.5), rel_tol=1e-5)  # greedy: T treated as 1
    scaled = torch.log_softmax(LOGITS / 0.5, -1)
    assert math.isclose(logprobs[2].item(), scaled[tokens[2]].item(), rel_tol=1e-5)


def test_seeded_rows_repeat_whatever_shares_their_batch():
    p = parse_sampling({"sampling_seed": 5})
    alone = [sample_tokens(LOGITS[None], [p], [step])[0].item() for step in range(40)]
    again = [sample_tokens(LOGITS[None], [p], [step])[0].item() for step in range(40)]
    assert alone == again
    assert len(set(alone)) > 1  # the step moves the draw
    other = parse_sampling({"temperature": 0.3})
    torch.manual_seed(1)
    crowded = [sample_tokens(LOGITS.repeat(3, 1), [other, p, other], [9, step, 2])[0][1].item() for step in range(40)]
    assert crowded == alone  # neighbours, slot and the global RNG do not move a seeded draw


def test_seeded_draws_follow_the_distribution_and_the_truncation():
    n = 4000
    params = [parse_sampling({"sampling_seed": s}) for s in range(n)]
    tokens, _ = sample_tokens(LOGITS.repeat(n, 1), params, [0] * n)
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert torch.allclose(freq, PROBS.double(), atol=0.025), freq  # 4-sigma band at n = 4000
    top2 = [parse_sampling({"sampling_seed": s, "top_k": 2}) for s in range(400)]
    assert set(sample_tokens(LOGITS.repeat(400, 1), top2, [3] * 400)[0].tolist()) == {0, 1}


def test_seeded_uniform_is_well_spread_and_separates_seeds_and_steps():
    from posttrain.plugins.engines.local.sampling import seeded_uniform

    u = seeded_uniform(torch.tensor([0, 1, 2**40 + 1, -3]), torch.tensor([0, 0, 0, 5]), 10_000)
    assert u.shape == (4, 10_000) and bool(((u > 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 0.01
    assert len({tuple(r[:8].tolist()) for r in u}) == 4  # different seeds (and high bits) differ
    again = seeded_uniform(torch.tensor([1]), torch.tensor([1]), 10_000)
    assert not torch.equal(again[0], u[1])  # step 1 differs from step 0


def test_seeded_rows_need_their_steps():
    with pytest.raises(ValueError, match="steps"):
        sample_tokens(LOGITS[None], [parse_sampling({"sampling_seed": 1})])


@pytest.mark.parametrize("raw, key", [
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"stop": [""]}, "stop"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"temprature": 1}, "temprature"), ("x", "expected an object"),
])
def test_bad_values_name_the_key(raw, key):
    with pytest.raises(SamplingError, match=key):
        parse_sampling(raw)


def test_nulls_mean_defaults_and_a_single_stop_string_is_a_list():
    p = parse_sampling({"temperature": None, "stop": "###", "max_new_tokens": None})
    assert p.temperature == 1.0 and p.stop == ["###"] and p.max_new_tokens == 128


def test_rows_differing_only_in_their_seed_parse_like_each_row_alone():
    base = {"max_new_tokens": 1, "temperature": 0.7, "stop": ["x"], "sampling_seed": 1}
    rows = [base, {**base, "sampling_seed": 2}, {**base, "sampling_seed": 2}, {**base, "temperature": 0.5},
            {**base, "temperature": 0.5, "sampling_seed": None}, {"max_new_tokens": 1}, {"max_new_tokens": 1}]
    assert parse_sampling_rows(rows) == [parse_sampling(r) for r in rows]
    assert [p.sampling_seed for p in parse_sampling_rows(rows)] == [1, 2, 2, 1, None, None, None]


@pytest.mark.parametrize("bad", [{"sampling_seed": 2**63}, {"sampling_seed": True}, {"sampling_seed": 1.5},
                                 {"top_k": True}, {"temperature": True}, {"stop": [""]}])
def test_a_row_is_refused_whatever_row_came_before_it(bad):
    good = {"top_k": 1, "temperature": 1, "stop": ["a"], "sampling_seed": 3}
    with pytest.raises(SamplingError):
        parse_sampling_rows([good, {**good, **bad}])
