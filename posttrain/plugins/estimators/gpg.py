"""GPG advantages: group mean-centred rewards, rescaled by the share of non-zero rewards in the batch."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Estimator
from posttrain.core.types import AdvantageBatch


class GPG(Estimator):
    """GPG (Chu et al., 2025): ``A_i = alpha (r_i - mean_g) / f_norm``, ``alpha = B / #{j : r_j != 0}``.

    Group Policy Gradient: plain REINFORCE with a group-mean baseline (no std division, no ratio
    clipping in the paper; pair it with any policy loss). ``alpha`` compensates for the samples that carry
    no signal: with binary rewards, the batch gradient is rescaled as if only the samples with a non-zero
    reward had been drawn (verl's ``gpg``). A group of one sample keeps ``alpha * r_i / f_norm``.
    ``token_rewards`` are summed per sample into ``r_i`` first (as in ``grpo``), before ``alpha`` is counted.

    Shapes: ``rewards [B]``, ``group_index [B]``, ``response_mask [B, T]`` -> advantages = returns
    ``[B, T]``, 0 where the mask is 0.
    """

    name = "gpg"
    group_baseline = False  # alpha counts non-zero rewards, which a shift changes

    @dataclass
    class Config:
        f_norm: float = option(1.0, gt=0.0, help="constant the advantages are divided by")

    def advantages(self, batch: AdvantageBatch):
        from posttrain.core.group_stats import group_mean_std, sequence_scores

        rewards = sequence_scores(batch)
        mean, _ = group_mean_std(rewards, batch.group_index)
        alpha = len(rewards) / max(int((rewards != 0).sum()), 1)
        advantages = (alpha * (rewards - mean) / self.config.f_norm).unsqueeze(-1) * batch.response_mask
        return advantages, advantages.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(GPG)
