"""The PPO clipped surrogate loss, with asymmetric (clip-higher) bounds and optional dual clip."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.core.losses import AggregationMode, PolicyLoss


class PPOClip(PolicyLoss):
    """PPO clip: ``L = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))``, optional dual clip.

    PPO clipped surrogate (Schulman et al., 2017) with DAPO's clip-higher and the dual clip (Ye et al., 2020).

    Per token, with ``ratio = exp(clamp(logp - logp_old, -20, 20))``::

        L_t = max(-A_t * ratio, -A_t * clip(ratio, 1 - clip_low, 1 + clip_high))
        L_t = min(L_t, -dual_clip * A_t)      where A_t < 0, if dual_clip (c > 1) is set
        L_t = 0                               if opsm_delta is set, A_t < 0 and kl_i > opsm_delta

    with ``kl_i = sum_t m_it (logp_old - logp)_it / n_i`` (no gradient): Off-Policy Sequence Masking, as
    slime's ``--use-opsm``, drops negative-advantage sequences the policy has already moved far from.
    Then multiplied by ``is_weights`` and reduced with ``aggregation`` (``posttrain.core.losses.aggregate``).
    Metrics: ``clipfrac`` (tokens where the clipped term is the larger, i.e. the gradient is cut),
    ``approx_kl`` (k3 of pi_old against pi), ``ratio_mean``, ``pg_loss``, and with the
    options on, ``dual_clipfrac`` and ``opsm_frac`` (tokens masked by OPSM).

    Shapes: ``log_probs, old_log_probs, advantages, response_mask, is_weights``: ``[B, T]`` -> scalar.
    """

    name = "ppo_clip"

    @dataclass
    class Config:
        clip_low: float = option(0.2, ge=0.0, help="lower clip: ratio >= 1 - clip_low")
        clip_high: float = option(0.28, ge=0.0, help="upper clip: ratio <= 1 + clip_high (DAPO clip-higher)")
        dual_clip: float | None = option(None, gt=1.0, help="dual-clip constant c > 1 for A < 0 (None: off)")
        opsm_delta: float | None = option(None, gt=0.0, help="mask sequences with A < 0 whose mean "
                                                             "log(pi_old/pi) exceeds this (None: off)")
        aggregation: AggregationMode = option("token-mean", help="how per-token losses become one scalar")
        max_response_len: int | None = option(None, ge=1, help="constant normalizer of seq-mean-token-sum-norm "
                                                              "(None: the padded T)")

    def token_losses(self, log_probs, old_log_probs, advantages, mask):
        import torch

        from posttrain.core.losses import clamped_log_ratio

        c = self.config
        ratio = clamped_log_ratio(log_probs, old_log_probs).exp()
        # max(-A r, -A clip(r)) = -A min(r, 1 + clip_high) for A > 0 and -A max(r, 1 - clip_low) for A < 0:
        # one clamp per sign instead of both surrogates (fewer passes over [B, T])
        positive = advantages > 0
        bounded = torch.where(positive, ratio.clamp(max=1 + c.clip_high), ratio.clamp(min=1 - c.clip_low))
        loss = -advantages * bounded
        clipped = torch.where(positive, ratio > 1 + c.clip_high, (ratio < 1 - c.clip_low) & (advantages < 0))
        flags = {"clipfrac": clipped}
        if c.dual_clip is not None:
            lower = -c.dual_clip * advantages
            dual = (advantages < 0) & (loss > lower)
            loss = torch.where(dual, lower, loss)
            flags = {"clipfrac": clipped | dual, "dual_clipfrac": dual}
        if c.opsm_delta is not None:
            with torch.no_grad():
                seq_kl = ((old_log_probs - log_probs) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
                opsm = (advantages < 0) & (seq_kl > c.opsm_delta).unsqueeze(-1)
            loss = torch.where(opsm, torch.zeros_like(loss), loss)
            flags["opsm_frac"] = opsm
        return loss, ratio, flags


@hookimpl
def posttrain_register_losses(registry):
    registry.add(PPOClip)
