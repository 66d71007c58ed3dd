"""RLOO advantages: each reward minus the mean reward of the other samples of its group."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl
from posttrain.api import Estimator
from posttrain.core.types import AdvantageBatch


class RLOO(Estimator):
    """RLOO (Kool et al., 2019): ``A_i = r_i - (sum_g r - r_i) / (n_g - 1)`` on every response token.

    REINFORCE Leave-One-Out (Kool et al., 2019; Ahmadian et al., 2024).

    ``A_i = r_i - (sum_g r - r_i) / (n_g - 1)`` on every response token: the baseline of sample ``i`` is
    the mean reward of the *other* ``n_g - 1`` samples of its group, so it is independent of ``r_i``
    (an unbiased baseline). Equivalently ``A_i = n_g / (n_g - 1) * (r_i - mean_g)``. A group of one
    sample has no other samples and keeps its raw reward (verl does the same). No std normalization.
    ``token_rewards`` are summed per sample into ``r_i`` first (as in ``grpo``).

    Shapes: ``rewards [B]``, ``group_index [B]``, ``response_mask [B, T]`` -> advantages = returns
    ``[B, T]``, 0 where the mask is 0.
    """

    name = "rloo"
    group_baseline = True

    @dataclass
    class Config:
        pass

    def advantages(self, batch: AdvantageBatch):
        import torch

        from posttrain.core.group_stats import group_sum_count, sequence_scores

        rewards = sequence_scores(batch)
        total, count = group_sum_count(rewards, batch.group_index)
        baseline = (total - rewards) / (count - 1).clamp(min=1)
        scores = torch.where(count > 1, rewards - baseline, rewards)
        advantages = scores.unsqueeze(-1) * batch.response_mask
        return advantages, advantages.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(RLOO)
