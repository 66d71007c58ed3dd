"""GSPO: PPO clipping on the sequence-level (geometric-mean) importance ratio."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.core.losses import AggregationMode, PolicyLoss


class GSPO(PolicyLoss):
    """GSPO (Zheng et al., 2025): PPO clip on the sequence ratio ``s_i = exp(mean_t (logp - logp_old))``.

    Group Sequence Policy Optimization (Zheng et al., 2025), the GSPO-token form.

    The sequence ratio is the geometric mean of token ratios, ``s_i = exp(sum_t m_it d_it / n_i)`` with
    ``d = clamp(logp - logp_old, -20, 20)``. Each token uses ``s_it = sg(s_i) * exp(logp_it - sg(logp_it))``:
    equal to ``s_i`` in value, with a straight-through gradient ``s_i * grad logp_it`` per token. Then::

        L_it = max(-A_it * s_it, -A_it * clip(s_it, 1 - clip_low, 1 + clip_high))

    clipped at the sequence level (all tokens of a sequence are clipped together), times ``is_weights``,
    reduced with ``aggregation`` (default ``seq-mean-token-mean``, which makes the gradient the paper's
    ``s_i A_i * mean_t grad logp_it`` per sequence). The defaults ``clip_low=3e-4``, ``clip_high=4e-4``
    are the paper's: sequence ratios stay much closer to 1 than token ratios.
    Metrics as ``ppo_clip`` (``clipfrac`` counts tokens of clipped sequences).

    Shapes: ``log_probs, old_log_probs, advantages, response_mask, is_weights``: ``[B, T]`` -> scalar.
    """

    name = "gspo"

    @dataclass
    class Config:
        clip_low: float = option(3e-4, ge=0.0, help="lower clip of the sequence ratio: s >= 1 - clip_low")
        clip_high: float = option(4e-4, ge=0.0, help="upper clip of the sequence ratio: s <= 1 + clip_high")
        aggregation: AggregationMode = option("seq-mean-token-mean", help="how per-token losses become one scalar")
        max_response_len: int | None = option(None, ge=1, help="constant normalizer of seq-mean-token-sum-norm "
                                                              "(None: the padded T)")

    def token_losses(self, log_probs, old_log_probs, advantages, mask):
        import torch

        from posttrain.core.losses import clamped_log_ratio

        d = torch.where(mask > 0, clamped_log_ratio(log_probs, old_log_probs), torch.zeros_like(log_probs))
        seq_log_ratio = (d.sum(-1) / mask.sum(-1).clamp(min=1)).detach()
        # value: s_i on every token; gradient: s_i * d logp_it (straight-through per token)
        log_s = seq_log_ratio.unsqueeze(-1) + log_probs - log_probs.detach()
        ratio = log_s.clamp(max=20.0).exp()
        c = self.config
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1 - c.clip_low, 1 + c.clip_high)
        return torch.maximum(unclipped, clipped), ratio, {"clipfrac": clipped > unclipped}


@hookimpl
def posttrain_register_losses(registry):
    registry.add(GSPO)
