"""CISPO: REINFORCE with clipped, stop-gradient importance weights (every token keeps its gradient)."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.core.losses import AggregationMode, PolicyLoss


class CISPO(PolicyLoss):
    """CISPO (MiniMax-M1, 2025): ``L = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) A logp``.

    Clipped IS-weight Policy Optimization (MiniMax-M1, 2025).

    Per token, with ``ratio = exp(clamp(logp - logp_old, -20, 20))``::

        L_t = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A_t * logp_t

    Unlike PPO's clip, no token loses its gradient: only the weight is truncated. The paper bounds the
    weight from above only, hence the default ``clip_low = 1.0`` (lower bound 0; slime warns unless it is
    >= 1). Times ``is_weights``, reduced with ``aggregation``. ``clipfrac`` counts tokens whose weight was
    truncated. The loss *value* is not a surrogate of the objective (it is ``-w A logp``); its gradient is.

    Shapes: ``log_probs, old_log_probs, advantages, response_mask, is_weights``: ``[B, T]`` -> scalar.
    """

    name = "cispo"

    @dataclass
    class Config:
        clip_low: float = option(1.0, ge=0.0, help="weight >= 1 - clip_low (1.0: no lower bound)")
        clip_high: float = option(0.28, ge=0.0, help="weight <= 1 + clip_high")
        aggregation: AggregationMode = option("token-mean", help="how per-token losses become one scalar")
        max_response_len: int | None = option(None, ge=1, help="constant normalizer of seq-mean-token-sum-norm "
                                                              "(None: the padded T)")

    def token_losses(self, log_probs, old_log_probs, advantages, mask):
        from posttrain.core.losses import clamped_log_ratio

        c = self.config
        ratio = clamped_log_ratio(log_probs, old_log_probs).exp().detach()
        weight = ratio.clamp(1 - c.clip_low, 1 + c.clip_high)
        return -weight * advantages * log_probs, ratio, {"clipfrac": weight != ratio}


@hookimpl
def posttrain_register_losses(registry):
    registry.add(CISPO)
