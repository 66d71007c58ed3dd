"""GMPO: the geometric mean of token-clipped ratios as the sequence ratio."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.core.losses import AggregationMode, PolicyLoss


class GMPO(PolicyLoss):
    """GMPO (Zhao et al., 2025): ``L_i = -A_i exp(mean_t sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -lo, hi)))``.

    Geometric-Mean Policy Optimization, as verl's ``geo_mean`` loss. With the token log-ratio
    ``d_t = logp_t - logp_old_t``, each token's log-ratio is clipped in log space to ``[-clip_low, clip_high]``
    (pessimistically for the advantage's sign, as PPO does), and the sequence ratio is the geometric mean of
    the clipped token ratios: outlier tokens move the sequence ratio far less than in an arithmetic mean.
    ``A_i`` is the mean advantage over the sequence's tokens (GMPO uses sequence-level advantages).
    Every token of sequence ``i`` carries ``L_i`` in value, with a straight-through gradient
    ``-A_i r_i grad(clipped d_t)`` of its own token only (as ``gspo``), so that the default aggregation
    ``seq-mean-token-mean`` gives ``mean_i L_i`` and exactly the paper's gradient, and a zero IS weight on a
    token removes that token's gradient. ``is_weights`` multiply per token before aggregation (verl takes
    their geometric mean per sequence instead). The default wide clip ``0.4`` in log space is the paper's.
    ``clipfrac`` counts tokens whose log-ratio was clipped.

    Shapes: ``log_probs, old_log_probs, advantages, response_mask, is_weights``: ``[B, T]`` -> scalar.
    """

    name = "gmpo"

    @dataclass
    class Config:
        clip_low: float = option(0.4, ge=0.0, help="log-ratio lower clip: d >= -clip_low")
        clip_high: float = option(0.4, ge=0.0, help="log-ratio upper clip: d <= clip_high")
        aggregation: AggregationMode = option("seq-mean-token-mean", help="how per-token losses become one scalar")
        max_response_len: int | None = option(None, ge=1, help="constant normalizer of seq-mean-token-sum-norm "
                                                              "(None: the padded T)")

    def token_losses(self, log_probs, old_log_probs, advantages, mask):
        import torch

        from posttrain.core.losses import clamped_log_ratio

        c = self.config
        d = clamped_log_ratio(log_probs, old_log_probs)
        lengths = mask.sum(-1).clamp(min=1)
        seq_adv = (advantages * mask).sum(-1) / lengths  # [B]
        sign = torch.sign(seq_adv).unsqueeze(-1)
        clipped_d = d.clamp(-c.clip_low, c.clip_high)
        pessimistic = sign * torch.minimum(sign * d, sign * clipped_d)
        pessimistic = torch.where(mask > 0, pessimistic, torch.zeros_like(pessimistic))
        seq_ratio = (pessimistic.sum(-1) / lengths).detach().exp()  # [B] geometric mean of clipped ratios
        # value: the sequence ratio on every token; gradient: seq_ratio * d pessimistic_t (straight-through)
        ratio = seq_ratio.unsqueeze(-1) * (pessimistic - pessimistic.detach()).exp()
        return -seq_adv.unsqueeze(-1) * ratio, ratio, {"clipfrac": (clipped_d != d) & (sign != 0)}


@hookimpl
def posttrain_register_losses(registry):
    registry.add(GMPO)
