"""GRPO advantages: each sample's reward standardized within its group."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Estimator
from posttrain.core.types import AdvantageBatch


class GRPO(Estimator):
    """GRPO (Shao et al., 2024): ``A_i = (r_i - mean_g) / (std_g + epsilon)`` on every response token.

    Group Relative Policy Optimization with outcome supervision: sample ``i`` of group ``g`` gets the same
    advantage on every response token; ``std_g`` is Bessel-corrected (unbiased), as slime and verl compute it.
    ``normalize_std=False`` gives the mean-centred form. A group of one sample keeps its raw reward
    (mean 0, std 1), since there is nothing to compare it with. A group whose rewards are all equal
    gets advantage 0.

    ``pass_k = k > 1`` trains for the best of ``k`` tries instead of the mean (Pass@k Training, Chen et al.,
    2025, arXiv 2508.10751, generalized from 0/1 rewards to max@k): with ``S`` a random ``k``-subset of the
    group and ``M_S = max_{j in S} r_j`` (:func:`posttrain.core.group_stats.group_max_at_k`)::

        A_i = (E_S[M_S | i in S] - E_S[M_S]) / (std_S(M_S) + epsilon)

    For 0/1 rewards, ``c`` of ``n`` correct: a correct sample gets ``(1 - p) / sigma``, a wrong one
    ``(1 - p - C(n-c-1, k-1) / C(n-1, k-1)) / sigma`` with ``p = 1 - C(n-c, k) / C(n, k)`` and
    ``sigma = sqrt(p (1 - p))``. Against ``k = 1`` (GRPO with the population std) a wrong sample is pushed
    down less, and rare successes weigh more than common ones, so a prompt the policy mostly gets wrong
    keeps more probability on its other answers. Groups of ``k`` samples or fewer get 0 but a lone sample,
    which keeps its raw reward.

    ``token_rewards`` (e.g. a KL penalty in the reward) are summed per sample into ``r_i`` before the
    group statistics (verl's convention: the sequence score is the sum of its token rewards).
    Unlike slime, groups are found by ``group_index``, not by position.

    Shapes: ``rewards [B]``, ``group_index [B]``, ``response_mask [B, T]`` -> advantages and
    returns ``[B, T]`` (equal for GRPO), exactly 0 where the mask is 0.
    """

    name = "grpo"
    group_baseline = True  # invariant to a constant added to one group's rewards

    @dataclass
    class Config:
        normalize_std: bool = option(True, help="divide by the group std (False: mean-centred only)")
        epsilon: float = option(1e-6, gt=0.0, help="added to the std before dividing")
        pass_k: int = option(1, ge=1, help="train for the best of k samples (max@k; pass@k for 0/1 rewards): "
                                           "wrong samples are pushed down less, rare successes weigh more")

    def advantages(self, batch: AdvantageBatch):
        import torch

        from posttrain.core.group_stats import group_max_at_k, group_mean_std, group_sum_count, sequence_scores

        rewards = sequence_scores(batch)
        if self.config.pass_k == 1:
            mean, std = group_mean_std(rewards, batch.group_index)
            scores = rewards - mean
        else:
            with_i, mean, std = group_max_at_k(rewards, batch.group_index, self.config.pass_k)
            _, size = group_sum_count(rewards, batch.group_index)
            scores = torch.where(size == 1, rewards, with_i - mean)
            std = torch.where(size == 1, torch.ones_like(std), std)
        if self.config.normalize_std:
            scores = scores / (std + self.config.epsilon)
        advantages = scores.unsqueeze(-1) * batch.response_mask
        return advantages, advantages.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(GRPO)
