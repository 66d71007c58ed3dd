"""Pass@k advantages: only the best sample of each group learns, by its margin over the runner-up."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Estimator
from posttrain.core.types import AdvantageBatch


class GRPOPassK(Estimator):
    """Pass@k GRPO (arXiv 2503.19595, verl's ``grpo_passk``): ``A_best = (r_max - r_2nd) / (std_g + epsilon)``.

    In each group, the single best sample gets the margin of its reward over the second-best one, divided
    by the group's Bessel-corrected std when ``normalize_std``; every other sample gets 0. This optimizes
    the best-of-k reward rather than the mean. When several samples share the maximum, the margin is 0 and
    the whole group gets 0 (so the result never depends on sample order). A group of one sample keeps its
    raw reward (std 1), as in ``grpo``. ``token_rewards`` are summed per sample into ``r_i`` first.

    Shapes: ``rewards [B]``, ``group_index [B]``, ``response_mask [B, T]`` -> advantages = returns
    ``[B, T]``, 0 where the mask is 0.
    """

    name = "grpo_passk"
    group_baseline = True  # max, runner-up and std all move with a per-group shift

    @dataclass
    class Config:
        normalize_std: bool = option(True, help="divide the margin by the group std")
        epsilon: float = option(1e-6, gt=0.0, help="added to the std before dividing")

    def advantages(self, batch: AdvantageBatch):
        import torch

        from posttrain.core.group_stats import group_inverse, group_mean_std, group_sum_count, sequence_scores

        rewards = sequence_scores(batch)
        inverse, n_groups = group_inverse(batch.group_index)

        def group_max(values):
            out = torch.full((n_groups,), -torch.inf, dtype=values.dtype, device=values.device)
            return out.scatter_reduce(0, inverse, values, reduce="amax")[inverse]

        best = group_max(rewards)
        is_best = rewards == best
        n_best, size = group_sum_count(is_best.to(rewards.dtype), batch.group_index)
        runner_up = group_max(torch.where(is_best, torch.full_like(rewards, -torch.inf), rewards))
        margin = torch.where(is_best & (n_best == 1) & (size > 1), best - runner_up, torch.zeros_like(rewards))
        scores = torch.where(size == 1, rewards, margin)
        if self.config.normalize_std:
            _, std = group_mean_std(rewards, batch.group_index)
            scores = scores / (std + self.config.epsilon)
        advantages = scores.unsqueeze(-1) * batch.response_mask
        return advantages, advantages.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(GRPOPassK)
