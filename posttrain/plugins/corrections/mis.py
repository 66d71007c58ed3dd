"""MIS: importance weights at token, sequence or geometric level, masked, truncated or clipped to bounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain import hookimpl, option
from posttrain.api import Component


class MIS(Component):
    """MIS: sequence weights ``rho = exp(sum_t (logp_train - logp_rollout))``, 0 outside ``[low, high]``.

    Masked importance sampling for the rollout/training mismatch, with the options of slime's ``mis.py``.
    From token log-ratios ``d_t = logp_train_old - logp_rollout`` over the mask, the raw weight is
    ``level="token"``: ``exp(d_t)``; ``level="sequence"`` (default): ``exp(sum_t d_t)``, the exact sequence
    ratio, on every token of the sequence; ``level="geometric"``: ``exp(mean_t d_t)`` (length-normalized).
    The exponent is clamped to +-20. Then ``mode="mask"`` (default) sets weights outside ``[low, high]`` to 0
    (a sequence the engines disagree on is dropped whole), ``"truncate"`` caps them at ``high``, ``"clip"``
    clamps them to ``[low, high]``. With ``veto_threshold``, a sequence with any token ratio below it gets
    weight 0 everywhere. Without gradient.

    Unlike slime, tokens with weight 0 stay in the aggregation's denominators (slime also removes masked
    tokens from the loss mask); the trainer may drop them with ``response_mask * (is_weights > 0)``.
    Call ``mis(train_log_probs, rollout_log_probs, response_mask) -> (is_weights, metrics)``, all ``[B, T]``;
    ``is_weights`` is 0 outside the mask. Metrics: ``train_rollout_logprob_abs_diff``, ``is_weight_mean``,
    ``is_masked_frac`` (tokens set to 0), ``is_clipped_frac`` (tokens truncated or clipped),
    ``is_ratio_mean``, ``is_seq_masked_frac`` (sequences with every weight 0), ``is_veto_seq_frac``.
    """

    name = "mis"

    @dataclass
    class Config:
        low: float = option(0.5, ge=0.0, help="lower bound of the weight (mask and clip modes)")
        high: float = option(2.0, gt=0.0, help="upper bound of the weight")
        level: Literal["token", "sequence", "geometric"] = option(
            "sequence", help="token ratio, sequence ratio (product), or their geometric mean")
        mode: Literal["mask", "truncate", "clip"] = option(
            "mask", help="out-of-bounds weights: set to 0, capped at high, or clamped to [low, high]")
        veto_threshold: float | None = option(None, gt=0.0, help="zero a whole sequence if any token ratio is "
                                                                 "below this (None: off)")

        def validate(self) -> list[str]:
            return [] if self.low <= self.high else [f"low: {self.low} is above high {self.high}"]

    def __call__(self, train_log_probs, rollout_log_probs, response_mask):
        import torch

        from posttrain.core.losses import LOG_RATIO_LIMIT, mismatch_metrics

        c = self.config
        with torch.no_grad():
            mask = response_mask.to(train_log_probs.dtype)
            d = train_log_probs.detach() - rollout_log_probs.detach()
            d = torch.where(mask > 0, d, torch.zeros_like(d))
            if c.level == "token":
                log_w = d
            else:
                log_w = d.sum(-1, keepdim=True)
                if c.level == "geometric":
                    log_w = log_w / mask.sum(-1, keepdim=True).clamp(min=1)
                log_w = log_w.expand_as(d)
            raw = log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
            zero = torch.zeros_like(raw)
            outside = (raw < c.low) | (raw > c.high)
            masked = torch.zeros_like(outside)
            clipped = torch.zeros_like(outside)
            if c.mode == "mask":
                weights, masked = torch.where(outside, zero, raw), outside
            elif c.mode == "truncate":
                weights, clipped = raw.clamp(max=c.high), raw > c.high
            else:
                weights, clipped = raw.clamp(c.low, c.high), outside
            has_tokens = mask.sum(-1) > 0
            vetoed = torch.zeros_like(has_tokens)
            if c.veto_threshold is not None:
                vetoed = ((d.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp() < c.veto_threshold) & (mask > 0)).any(-1)
                weights = torch.where(vetoed.unsqueeze(-1), zero, weights)
                masked = masked | vetoed.unsqueeze(-1)
            weights = torch.where(mask > 0, weights, zero)
            metrics = mismatch_metrics(train_log_probs, rollout_log_probs, mask, weights, masked, clipped & ~masked)
            n_seqs = has_tokens.sum().clamp(min=1)
            all_zero = ((weights == 0) | (mask == 0)).all(-1) & has_tokens
            metrics["is_seq_masked_frac"] = float(all_zero.sum() / n_seqs)
            metrics["is_veto_seq_frac"] = float((vetoed & has_tokens).sum() / n_seqs)
        return weights, metrics


@hookimpl
def posttrain_register_corrections(registry):
    registry.add(MIS)
