"""TIS: token-level truncated importance weights for the rollout/training mismatch."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Component


class TIS(Component):
    """TIS: token weights ``w = clamp(exp(logp_train - logp_rollout), low, high)``.

    Truncated Importance Sampling (Yao et al., 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"), as slime's ``--use-tis``.

    The rollout engine (SGLang) and the trainer compute slightly different probabilities for the same
    tokens. Each token's loss is reweighted by ``w_t = clamp(exp(logp_train_old - logp_rollout), low, high)``
    (defaults ``[0, 2]``), without gradient; the policy loss multiplies its per-token terms by ``w``.
    Call ``tis(train_log_probs, rollout_log_probs, response_mask) -> (is_weights, metrics)``, all
    ``[B, T]``; ``is_weights`` is 0 outside the mask. Metrics: ``train_rollout_logprob_abs_diff``,
    ``is_weight_mean``, ``is_clipped_frac`` (weights truncated to a bound), ``is_masked_frac`` (0 here),
    ``is_ratio_mean``.
    """

    name = "tis"
    fully_async_default = True  # the correction of a rollout.mode: fully_async run that names none

    @dataclass
    class Config:
        low: float = option(0.0, ge=0.0, help="lower bound of the weight")
        high: float = option(2.0, gt=0.0, help="upper bound of the weight")

        def validate(self) -> list[str]:
            return [] if self.low <= self.high else [f"low: {self.low} is above high {self.high}"]

    def __call__(self, train_log_probs, rollout_log_probs, response_mask):
        import torch

        from posttrain.core.losses import clamped_log_ratio, mismatch_metrics

        with torch.no_grad():
            mask = response_mask.to(train_log_probs.dtype)
            ratio = clamped_log_ratio(train_log_probs.detach(), rollout_log_probs.detach()).exp()
            weights = torch.where(mask > 0, ratio.clamp(self.config.low, self.config.high), 0.0)
            clipped = (ratio < self.config.low) | (ratio > self.config.high)
            metrics = mismatch_metrics(train_log_probs, rollout_log_probs, mask, weights,
                                       torch.zeros_like(clipped), clipped)
        return weights, metrics


@hookimpl
def posttrain_register_corrections(registry):
    registry.add(TIS)
