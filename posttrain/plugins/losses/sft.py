"""Supervised fine-tuning: token-level cross-entropy on the labelled response tokens."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.core.losses import AggregationMode, PolicyLoss


class SFTLoss(PolicyLoss):
    """SFT cross-entropy: ``L_t = -logp_t`` on every token of ``response_mask``, reduced by ``aggregation``.

    The negative log-likelihood of the labelled tokens (``logp_t = log p(tokens[t] | tokens[:t])``), so
    with the default ``token-mean`` the loss is the mean NLL per trained token (``exp(loss)`` is the
    perplexity); ``seq-mean-token-mean`` weighs every sample the same, as the RL losses' modes do.
    ``advantages`` and ``old_log_probs`` take no part (the SFT mode passes ones and the log-probs
    themselves, so the trainer's interface stays the RL one); ``is_weights`` still scale the tokens
    (weighted SFT). ``ratio_mean``/``approx_kl`` report how far the policy moved from ``old_log_probs``
    and ``clipfrac`` is always 0. Use it with ``mode: sft`` (labelled data, no engines); under RL it
    would be behaviour cloning of the model's own samples.

    Shapes: ``log_probs, old_log_probs, advantages, response_mask, is_weights``: ``[B, T]`` -> scalar.
    """

    name = "sft"

    @dataclass
    class Config:
        aggregation: AggregationMode = option("token-mean", help="how per-token losses become one scalar")
        max_response_len: int | None = option(None, ge=1, help="constant normalizer of seq-mean-token-sum-norm "
                                                              "(None: the padded T)")

    def token_losses(self, log_probs, old_log_probs, advantages, mask):
        import torch

        from posttrain.core.losses import clamped_log_ratio

        ratio = clamped_log_ratio(log_probs.detach(), old_log_probs).exp()
        return -log_probs, ratio, {"clipfrac": torch.zeros_like(mask, dtype=torch.bool)}


@hookimpl
def posttrain_register_losses(registry):
    registry.add(SFTLoss)
