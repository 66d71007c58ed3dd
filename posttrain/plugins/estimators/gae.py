"""GAE advantages for PPO with a critic."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Estimator, EstimatorNeeds
from posttrain.core.types import AdvantageBatch


class GAE(Estimator):
    """GAE (Schulman et al., 2016): ``A_t = delta_t + gamma lam A_{t+1}``, ``delta_t = r_t + gamma V_{t+1} - V_t``.

    Generalized Advantage Estimation (Schulman et al., 2016) for PPO; needs critic ``values``.

    Per-token rewards ``r_t`` = the outcome reward on the last response token plus the optional dense
    ``token_rewards`` (e.g. ``-kl_coef * KL_t``), times the mask. With ``V_t = values * mask`` and
    ``V_T = 0`` after the end::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A + V                        (the critic's targets, before whitening)

    then ``A`` is whitened over all response tokens of the batch when ``whiten`` (the default, as verl and
    slime do). Every position counts one step (tokens masked in the middle of a response, such as tool
    output, pass the recursion through with their masked ``V = 0``; use ``gamma = lam = 1``, the
    defaults, to make that immaterial).

    Shapes: ``rewards [B]``, ``values [B, T]``, ``response_mask [B, T]`` -> advantages and returns
    ``[B, T]``, 0 where the mask is 0.
    """

    name = "gae"
    needs = EstimatorNeeds(critic=True)  # the loop computes critic values [B, T] (AdvantageBatch.values)
    group_baseline = False

    @dataclass
    class Config:
        gamma: float = option(1.0, ge=0.0, le=1.0, help="discount per token")
        lam: float = option(1.0, ge=0.0, le=1.0, help="GAE lambda (1: Monte-Carlo returns minus V)")
        whiten: bool = option(True, help="whiten the advantages over the batch's response tokens")

    def advantages(self, batch: AdvantageBatch):
        import torch

        from posttrain.core.group_stats import check_batch, masked_token_rewards, masked_whiten, outcome_token_rewards

        rewards = check_batch(batch, needs_values=True)
        mask = batch.response_mask.float()
        values = torch.where(mask > 0, batch.values.float(), 0.0)
        token_rewards = outcome_token_rewards(rewards, mask, masked_token_rewards(batch))
        gamma, lam = self.config.gamma, self.config.lam
        if gamma * lam == 1.0:
            # gamma = lam = 1 (the default): A_t = sum_{k >= t} delta_k, a reverse cumulative sum
            next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
            delta = token_rewards + gamma * next_values - values
            advantages = delta.flip(-1).cumsum(-1).flip(-1)
        else:
            # scan over time on [T, B] copies: each step then reads and writes one contiguous row
            rewards_tb, values_tb = token_rewards.T.contiguous(), values.T.contiguous()
            advantages_tb = torch.empty_like(values_tb)
            next_value = torch.zeros_like(values_tb[0])
            running = torch.zeros_like(values_tb[0])
            for t in range(values_tb.shape[0] - 1, -1, -1):
                delta = rewards_tb[t] + gamma * next_value - values_tb[t]
                running = delta + gamma * lam * running
                advantages_tb[t] = running
                next_value = values_tb[t]
            advantages = advantages_tb.T
        advantages = advantages * mask
        returns = (advantages + values) * mask
        if self.config.whiten:
            advantages = masked_whiten(advantages, mask)
        return advantages, returns


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(GAE)
