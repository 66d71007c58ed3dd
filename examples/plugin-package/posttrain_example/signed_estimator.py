"""Estimator `signed`: the sign of the group-centred reward, broadcast over response tokens."""

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Estimator


class SignedAdvantage(Estimator):
    """``A_i = scale * sign(s_i - mean_g)`` on every response token of sample ``i`` (group ``g``), where
    ``s_i`` is the reward plus the sample's summed ``token_rewards``.

    Shapes: ``rewards [B]``, ``group_index [B]``, ``response_mask [B, T]`` -> ``[B, T]`` twice.
    """

    name = "signed"
    group_baseline = True

    @dataclass
    class Config:
        scale: float = option(1.0, gt=0.0, help="magnitude of every advantage")

    def advantages(self, batch):
        import torch

        from posttrain.core.group_stats import group_mean_std, sequence_scores

        # sequence_scores: rewards [B] plus each sample's summed token_rewards, after the input checks
        # (shapes, NaN/inf: a ValueError naming the sample) that posttrain's EstimatorContract asks for
        scores = sequence_scores(batch)
        mean, _ = group_mean_std(scores, batch.group_index)
        centred = scores - mean
        # a tolerance, so float noise in the mean of equal rewards does not become +-1
        sign = torch.where(centred.abs() < 1e-6, torch.zeros_like(centred), centred.sign())
        adv = (self.config.scale * sign).unsqueeze(-1) * batch.response_mask
        return adv, adv.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(SignedAdvantage)
