"""IcePop: token-level importance weights, zeroed outside the trust bounds."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Component


class IcePop(Component):
    """IcePop: token weights ``w = exp(logp_train - logp_rollout)``, 0 outside ``[low, high]``.

    IcePop (Ling team, "Every step evolves", 2025), as slime's ``icepop_function``.

    Token weight ``w_t = r_t`` if ``low <= r_t <= high`` else ``0``, with
    ``r_t = exp(logp_train_old - logp_rollout)``: tokens where the engines disagree too much are dropped
    from the gradient instead of being truncated (that is the difference from ``tis``). Without gradient.
    Call ``icepop(train_log_probs, rollout_log_probs, response_mask) -> (is_weights, metrics)``, all
    ``[B, T]``; ``is_weights`` is 0 outside the mask. Metrics: ``train_rollout_logprob_abs_diff``,
    ``is_weight_mean``, ``is_masked_frac`` (tokens zeroed), ``is_clipped_frac`` (0 here), ``is_ratio_mean``.
    """

    name = "icepop"

    @dataclass
    class Config:
        low: float = option(0.5, ge=0.0, help="tokens with ratio below this get weight 0")
        high: float = option(2.0, gt=0.0, help="tokens with ratio above this get weight 0")

        def validate(self) -> list[str]:
            return [] if self.low <= self.high else [f"low: {self.low} is above high {self.high}"]

    def __call__(self, train_log_probs, rollout_log_probs, response_mask):
        import torch

        from posttrain.core.losses import clamped_log_ratio, mismatch_metrics

        with torch.no_grad():
            mask = response_mask.to(train_log_probs.dtype)
            ratio = clamped_log_ratio(train_log_probs.detach(), rollout_log_probs.detach()).exp()
            outside = (ratio < self.config.low) | (ratio > self.config.high)
            weights = torch.where(outside | (mask == 0), torch.zeros_like(ratio), ratio)
            metrics = mismatch_metrics(train_log_probs, rollout_log_probs, mask, weights, outside,
                                       torch.zeros_like(outside))
        return weights, metrics


@hookimpl
def posttrain_register_corrections(registry):
    registry.add(IcePop)
