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

    def advantages(self, batch: AdvantageBatch):
        from posttrain.core.group_stats import group_mean_std, sequence_scores

        rewards = sequence_scores(batch)
        mean, std = group_mean_std(rewards, batch.group_index)
        scores = rewards - mean
        if self.config.normalize_std:
            scores = scores / (std + self.config.epsilon)
        advantages = scores.unsqueeze(-1) * batch.response_mask
        return advantages, advantages.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(GRPO)
