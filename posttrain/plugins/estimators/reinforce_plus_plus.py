"""REINFORCE++ advantages: discounted per-token returns, whitened over the batch."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Estimator
from posttrain.core.types import AdvantageBatch


class ReinforcePlusPlus(Estimator):
    """REINFORCE++ (Hu, 2025): ``A = whiten(G)``, ``G_t = sum_k gamma^k r_{t+k}``, reward on the last token.

    REINFORCE++ (Hu, 2025), as slime and OpenRLHF implement it.

    Per-token rewards ``r_t`` = the outcome reward on each sample's last response token plus the optional
    dense ``token_rewards`` (e.g. ``-kl_coef * KL_t``), times the mask. Returns are discounted sums
    ``G_t = sum_{k >= 0} gamma^k r_{t+k}`` (every position counts one step; a masked position in the middle
    of a response, such as tool output, passes the return through, where verl resets it), and the advantages are
    ``G`` whitened over all response tokens of the batch: ``(G - mean) / sqrt(var + 1e-8)``, Bessel-
    corrected variance (slime asserts ``--normalize-advantages`` for this estimator; here it is built in).
    No group baseline: whitening uses batch statistics only.

    Shapes: ``rewards [B]``, ``response_mask [B, T]``, ``token_rewards [B, T] | None`` -> advantages
    (whitened) and returns (``G``, not whitened), both ``[B, T]``, 0 where the mask is 0.
    """

    name = "reinforce_plus_plus"
    group_baseline = False

    @dataclass
    class Config:
        gamma: float = option(1.0, ge=0.0, le=1.0, help="discount per token (1.0: undiscounted, the default)")

    def advantages(self, batch: AdvantageBatch):
        from posttrain.core.group_stats import (check_batch, discounted_returns, masked_token_rewards, masked_whiten,
                                                outcome_token_rewards)

        rewards = check_batch(batch)
        mask = batch.response_mask.float()
        token_rewards = outcome_token_rewards(rewards, mask, masked_token_rewards(batch))
        returns = discounted_returns(token_rewards, self.config.gamma) * mask
        return masked_whiten(returns, mask), returns


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(ReinforcePlusPlus)
