"""Estimator `signed`: the sign of the group-centred reward, broadcast over response tokens."""

from dataclasses import dataclass

from posttrain import hookimpl, option


class SignedAdvantage:
    """``A_i = scale * sign(r_i - mean_g)`` on every response token of sample ``i`` (group ``g``).

    Shapes: ``rewards [B]``, ``group_index [B]``, ``response_mask [B, T]`` -> ``[B, T]`` twice.
    """

    name = "signed"
    needs_critic = False
    group_baseline = True

    @dataclass
    class Config:
        scale: float = option(1.0, gt=0.0, help="magnitude of every advantage")

    def __init__(self, config=None):
        self.config = config or self.Config()

    def advantages(self, batch):
        import torch

        _, inverse = torch.unique(batch.group_index, return_inverse=True)
        rewards = batch.rewards.float()
        count = torch.zeros(int(inverse.max()) + 1).index_add_(0, inverse, torch.ones_like(rewards))
        mean = torch.zeros_like(count).index_add_(0, inverse, rewards) / count
        centred = rewards - mean[inverse]
        # a tolerance, so float noise in the mean of equal rewards does not become +-1
        sign = torch.where(centred.abs() < 1e-6, torch.zeros_like(centred), centred.sign())
        adv = (self.config.scale * sign).unsqueeze(-1) * batch.response_mask
        return adv, adv.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(SignedAdvantage)
