"""REINFORCE++ with a group-mean baseline, whitened over the batch."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl
from posttrain.api import Estimator
from posttrain.core.types import AdvantageBatch


class ReinforcePlusPlusBaseline(Estimator):
    """REINFORCE++-baseline (Hu, 2025): ``A = whiten(r_i - mean_g + token_rewards)`` over the batch.

    REINFORCE++-baseline (Hu, 2025), as slime implements it.

    ``A_it = whiten((r_i - mean_g) + token_rewards_it)`` over all response tokens of the batch:
    the group mean is subtracted (no std division), the optional dense ``token_rewards`` (e.g.
    ``-kl_coef * KL_t``) are added per token, and the result is whitened with the batch's masked mean and
    Bessel-corrected variance. A group of one sample keeps its raw reward before whitening.

    Shapes: ``rewards [B]``, ``group_index [B]``, ``response_mask [B, T]`` -> advantages (whitened) and
    returns (before whitening), both ``[B, T]``, 0 where the mask is 0.
    """

    name = "reinforce_plus_plus_baseline"
    group_baseline = True

    @dataclass
    class Config:
        pass

    def advantages(self, batch: AdvantageBatch):
        from posttrain.core.group_stats import check_batch, group_mean_std, masked_token_rewards, masked_whiten

        rewards = check_batch(batch)
        mask = batch.response_mask.float()
        mean, _ = group_mean_std(rewards, batch.group_index)
        returns = (rewards - mean).unsqueeze(-1).expand_as(mask)
        token_rewards = masked_token_rewards(batch)
        if token_rewards is not None:
            returns = returns + token_rewards
        returns = returns * mask
        return masked_whiten(returns, mask), returns


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(ReinforcePlusPlusBaseline)
