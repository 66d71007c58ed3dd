"""Dr. GRPO advantages: group mean-centred rewards, no std division."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl
from posttrain.api import Estimator
from posttrain.core.types import AdvantageBatch


class DrGRPO(Estimator):
    """Dr. GRPO (Liu et al., 2025): ``A_i = r_i - mean_g`` on every response token (no std).

    "GRPO done right": dropping the std division removes GRPO's question-difficulty bias; pair it with
    the loss aggregation ``seq-mean-token-sum-norm`` (a constant length normalizer) to remove the length
    bias too, as the paper and verl do (``norm_adv_by_std_in_grpo=False``). A group of one sample keeps its
    raw reward. ``token_rewards`` are summed per sample into ``r_i`` first (as in ``grpo``). The full recipe::

        estimator: {name: dr_grpo}
        loss: {name: ppo_clip, aggregation: seq-mean-token-sum-norm, max_response_len: 4096}

    Shapes: ``rewards [B]``, ``group_index [B]``, ``response_mask [B, T]`` -> advantages = returns
    ``[B, T]``, 0 where the mask is 0.
    """

    name = "dr_grpo"
    group_baseline = True

    @dataclass
    class Config:
        pass

    def advantages(self, batch: AdvantageBatch):
        from posttrain.core.group_stats import group_mean_std, sequence_scores

        rewards = sequence_scores(batch)
        mean, _ = group_mean_std(rewards, batch.group_index)
        advantages = (rewards - mean).unsqueeze(-1) * batch.response_mask
        return advantages, advantages.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(DrGRPO)
