"""ReMax advantages: reward minus the greedy sample's reward for the same prompt."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl
from posttrain.api import Estimator, EstimatorNeeds
from posttrain.core.types import AdvantageBatch


class ReMax(Estimator):
    """ReMax (Li et al., 2023): ``A_i = r_i - r_greedy_i``, REINFORCE with the greedy-decoding reward as baseline.

    ``A_i = r_i - b_i`` on every response token, where ``b_i = batch.metadata["baseline_rewards"][i]``
    (``[B]``) is the reward of the greedy (temperature 0) response to sample ``i``'s prompt: the loop
    generates and scores it because ``baseline_sampling`` asks for it (``posttrain.core.estimator_inputs``). ``token_rewards`` are summed per sample
    into ``r_i`` first. No whitening (as the paper and verl).

    Shapes: ``rewards [B]``, ``metadata["baseline_rewards"] [B]``, ``response_mask [B, T]`` ->
    advantages = returns ``[B, T]``, 0 where the mask is 0. A missing or misshapen baseline raises.
    """

    name = "remax"
    group_baseline = False  # the baseline comes from the greedy sample, not from the group's rewards
    needs = EstimatorNeeds(baseline_sampling={"temperature": 0.0})  # one greedy sample per prompt, scored

    @dataclass
    class Config:
        pass

    def advantages(self, batch: AdvantageBatch):
        import torch

        from posttrain.core.group_stats import check_finite, sequence_scores

        rewards = sequence_scores(batch)
        baseline = batch.metadata.get("baseline_rewards")
        if baseline is None:
            raise ValueError("remax needs batch.metadata['baseline_rewards'] ([B] reward of the greedy sample "
                             "per prompt); the generator must produce a greedy sample for each prompt")
        baseline = torch.as_tensor(baseline, device=rewards.device)
        if tuple(baseline.shape) != tuple(rewards.shape):
            raise ValueError(f"metadata['baseline_rewards'] has shape {tuple(baseline.shape)}, expected "
                             f"{tuple(rewards.shape)}")
        baseline = check_finite(baseline, what="baseline reward")
        advantages = (rewards - baseline).unsqueeze(-1) * batch.response_mask
        return advantages, advantages.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(ReMax)
