"""OPO advantages: reward minus the length-weighted mean reward of the group."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl
from posttrain.api import Estimator
from posttrain.core.types import AdvantageBatch


class OPO(Estimator):
    """OPO (Hao et al., 2025): ``A_i = r_i - sum_g(l_j r_j) / sum_g(l_j)``, ``l_j`` = response length.

    On-Policy RL with Optimal reward baseline (Hao et al., 2025).

    ``A_i = r_i - b_g`` on every response token, with the length-weighted baseline
    ``b_g = sum_{j in g} l_j r_j / sum_{j in g} l_j`` and ``l_j = sum_t response_mask[j, t]`` (the number
    of training tokens of sample ``j``): the variance-minimizing baseline for sequence-level rewards when
    the gradient norm grows with length. A group of one sample gets ``b = 0`` (verl does the same) and
    keeps its raw reward; a group whose samples have no training tokens gets advantage 0 everywhere
    (all its tokens are masked). ``token_rewards`` are summed per sample into ``r_i`` first.

    Shapes: ``rewards [B]``, ``group_index [B]``, ``response_mask [B, T]`` -> advantages = returns
    ``[B, T]``, 0 where the mask is 0.
    """

    name = "opo"
    group_baseline = True

    @dataclass
    class Config:
        pass

    def advantages(self, batch: AdvantageBatch):
        import torch

        from posttrain.core.group_stats import group_sum_count, sequence_scores

        rewards = sequence_scores(batch)
        lengths = batch.response_mask.float().sum(-1)
        weighted, total_length = group_sum_count(rewards, batch.group_index, weights=lengths)
        _, count = group_sum_count(rewards, batch.group_index)
        baseline = torch.where((count > 1) & (total_length > 0), weighted / total_length.clamp(min=1e-12),
                               torch.zeros_like(rewards))
        advantages = (rewards - baseline).unsqueeze(-1) * batch.response_mask
        return advantages, advantages.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(OPO)
