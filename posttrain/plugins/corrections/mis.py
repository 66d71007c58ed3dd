"""MIS: sequence-level importance weights, masking whole sequences outside the bounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain import hookimpl, option


class MIS:
    """MIS: sequence weights ``rho = exp(sum_t (logp_train - logp_rollout))``, 0 outside ``[low, high]``.

    Masked Importance Sampling at the sequence level (slime's ``mis.py`` mask mode; verl's rollout IS).

    Sequence ratio ``rho_i`` from token ratios ``r_it = exp(logp_train_old - logp_rollout)`` over the mask:
    ``level="sequence"``: ``rho_i = prod_t r_it = exp(sum_t m_it d_it)`` (the exact sequence ratio);
    ``level="geometric"``: ``rho_i = exp(sum_t m_it d_it / n_i)`` (length-normalized, as GSPO's ratio).
    Every token of sequence ``i`` gets ``w_it = rho_i`` if ``low <= rho_i <= high`` else ``0``: a sequence the
    trainer finds too unlikely (or too likely) under the rollout policy is dropped whole. The log-ratio sum
    is clamped to +-20 before ``exp``. Without gradient.
    Call ``mis(train_log_probs, rollout_log_probs, response_mask) -> (is_weights, metrics)``, all ``[B, T]``;
    ``is_weights`` is 0 outside the mask. Metrics: ``train_rollout_logprob_abs_diff``, ``is_weight_mean``,
    ``is_masked_frac`` (tokens of masked sequences), ``is_clipped_frac`` (0), ``is_ratio_mean``,
    ``is_seq_masked_frac`` (fraction of sequences masked).
    """

    name = "mis"

    @dataclass
    class Config:
        low: float = option(0.5, ge=0.0, help="sequences with ratio below this get weight 0")
        high: float = option(2.0, gt=0.0, help="sequences with ratio above this get weight 0")
        level: Literal["sequence", "geometric"] = option("sequence", help="product of token ratios, or their "
                                                                          "geometric mean")

        def validate(self) -> list[str]:
            return [] if self.low <= self.high else [f"low: {self.low} is above high {self.high}"]

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    def __call__(self, train_log_probs, rollout_log_probs, response_mask):
        import torch

        from posttrain.core.losses import mismatch_metrics

        with torch.no_grad():
            mask = response_mask.to(train_log_probs.dtype)
            d = (train_log_probs.detach() - rollout_log_probs.detach()) * mask
            d = torch.where(mask > 0, d, torch.zeros_like(d))
            seq = d.sum(-1)
            if self.config.level == "geometric":
                seq = seq / mask.sum(-1).clamp(min=1)
            rho = seq.clamp(-20.0, 20.0).exp()
            outside = (rho < self.config.low) | (rho > self.config.high)
            weights = torch.where(outside, torch.zeros_like(rho), rho).unsqueeze(-1) * mask
            masked = outside.unsqueeze(-1).expand_as(mask)
            metrics = mismatch_metrics(train_log_probs, rollout_log_probs, mask, weights, masked,
                                       torch.zeros_like(masked))
            has_tokens = mask.sum(-1) > 0
            metrics["is_seq_masked_frac"] = float((outside & has_tokens).sum() / has_tokens.sum().clamp(min=1))
        return weights, metrics


@hookimpl
def posttrain_register_corrections(registry):
    registry.add(MIS)
