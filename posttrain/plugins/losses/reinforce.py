"""Plain policy gradient: ``-A * logp`` (no ratio, no clipping)."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.core.losses import AggregationMode, PolicyLoss


class Reinforce(PolicyLoss):
    """REINFORCE: ``L_t = -A_t * logp_t`` per token (verl's ``gpg`` loss, the GPG paper's objective).

    The vanilla policy gradient: no importance ratio and no clipping, so it is exact on-policy only (one
    optimizer step per rollout, or accept the bias). Pair it with a baseline estimator (``gpg``,
    ``rloo``, ``grpo``). Times ``is_weights``, reduced with ``aggregation``. ``clipfrac`` is always 0;
    ``ratio_mean`` and ``approx_kl`` still report how far the policy has moved from ``old_log_probs``.

    Shapes: ``log_probs, old_log_probs, advantages, response_mask, is_weights``: ``[B, T]`` -> scalar.
    """

    name = "reinforce"

    @dataclass
    class Config:
        aggregation: AggregationMode = option("token-mean", help="how per-token losses become one scalar")
        max_response_len: int | None = option(None, ge=1, help="constant normalizer of seq-mean-token-sum-norm "
                                                              "(None: the padded T)")

    def token_losses(self, log_probs, old_log_probs, advantages, mask):
        import torch

        from posttrain.core.losses import clamped_log_ratio

        ratio = clamped_log_ratio(log_probs.detach(), old_log_probs).exp()
        return -advantages * log_probs, ratio, {"clipfrac": torch.zeros_like(mask, dtype=torch.bool)}


@hookimpl
def posttrain_register_losses(registry):
    registry.add(Reinforce)
