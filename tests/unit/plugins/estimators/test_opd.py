"""``opd``: each student token's advantage is the negative reverse KL to the teacher, from fixed logits."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.types import AdvantageBatch
from posttrain.plugins.estimators.opd import OnPolicyDistillation

# two samples over a 3-token vocabulary; sample 0 has two response tokens, sample 1 one (then padding)
STUDENT = [[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]], [[0.0, 1.0, 3.0], [0.0, 0.0, 0.0]]]
TEACHER = [[[0.0, 0.0, 0.0], [3.0, -2.0, 1.0]], [[1.0, 1.0, -1.0], [5.0, 5.0, 5.0]]]
SAMPLED = [[0, 2], [2, 0]]
MASK = [[1.0, 1.0], [1.0, 0.0]]


def _log_softmax(row, token):
    return row[token] - math.log(sum(math.exp(z) for z in row))


def _batch(rewards=(1.0, 0.0)):
    def gathered(logits):
        return torch.tensor([[_log_softmax(logits[i][t], SAMPLED[i][t]) * MASK[i][t] for t in range(2)]
                             for i in range(2)])

    return AdvantageBatch(rewards=torch.tensor(rewards), group_index=torch.tensor([0, 0]),
                          response_mask=torch.tensor(MASK), log_probs=gathered(STUDENT),
                          metadata={"teacher_log_probs": gathered(TEACHER)})


def test_advantages_are_the_negative_reverse_kl_per_token():
    estimator = OnPolicyDistillation()
    adv, ret = estimator.advantages(_batch())
    # by hand: log p(token) - log q(token) of each sampled token
    s00, t00 = 2 - math.log(math.e ** 2 + 1 + math.e ** -1), 0 - math.log(3)
    s01, t01 = 0 - math.log(2 * math.e ** 0.5 + 1), 1 - math.log(math.e ** 3 + math.e ** -2 + math.e)
    s10, t10 = 3 - math.log(1 + math.e + math.e ** 3), -1 - math.log(2 * math.e + math.e ** -1)
    expected = [[-(s00 - t00), -(s01 - t01)], [-(s10 - t10), 0.0]]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-6, rtol=0)
    assert torch.equal(adv, ret)
    kl = ((s00 - t00) + (s01 - t01) + (s10 - t10)) / 3
    assert estimator.metrics["reverse_kl"] == pytest.approx(kl, abs=1e-6)
    assert estimator.metrics["teacher_log_prob"] == pytest.approx((t00 + t01 + t10) / 3, abs=1e-6)


def test_task_reward_mixes_in_as_a_grpo_advantage():
    plain, _ = OnPolicyDistillation().advantages(_batch())
    mixed, _ = OnPolicyDistillation(OnPolicyDistillation.Config(kl_coef=0.5, reward_weight=2.0)).advantages(_batch())
    # rewards (1, 0) in one group: mean 0.5, Bessel std sqrt(0.5); the padding stays 0
    grpo = torch.tensor([[1.0, 1.0], [-1.0, 0.0]]) * 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(mixed, 0.5 * plain + 2.0 * grpo)


def test_missing_teacher_log_probs_is_a_clear_error():
    batch = _batch()
    batch.metadata = {}
    with pytest.raises(ValueError, match="teacher"):
        OnPolicyDistillation().advantages(batch)


def test_leave_one_out_baseline_subtracts_the_other_samples_mean_kl():
    plain, _ = OnPolicyDistillation().advantages(_batch())
    loo, _ = OnPolicyDistillation(OnPolicyDistillation.Config(baseline="leave_one_out")).advantages(_batch())
    # sample 0's baseline is sample 1's token-mean KL (one token) and vice versa (sample 0: two tokens)
    kl0, kl1 = -plain[0].mean().item(), -plain[1, 0].item()
    expected = plain + torch.tensor([[kl1, kl1], [kl0, 0.0]])
    torch.testing.assert_close(loo, expected)
    alone = _batch()
    alone.group_index = torch.tensor([0, 1])  # groups of one: no baseline
    torch.testing.assert_close(OnPolicyDistillation(OnPolicyDistillation.Config(baseline="leave_one_out"))
                               .advantages(alone)[0], plain)
