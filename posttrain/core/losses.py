"""Loss building blocks: aggregation, KL estimators, entropy, the critic's value loss, and the
policy-loss base class that the loss plugins (``posttrain/plugins/losses``) fill in.

Shapes: ``B`` sequences, ``T`` padded response tokens. Every per-token tensor is ``[B, T]``; the
``mask`` (``response_mask``) is 1.0 on response tokens that train and 0.0 elsewhere.

How the trainer combines the terms (the policy loss itself stays pure)::

    pg_loss, metrics = loss_fn(lp, old_lp, adv, mask, is_weights, global_tokens, global_seqs)
    kl  = aggregate(kl_divergence(lp, ref_lp, kind), mask, mode, global_tokens, global_seqs, max_len)
    ent = aggregate(entropy, mask, mode, global_tokens, global_seqs, max_len)
    total = pg_loss + kl_loss_coef * kl - entropy_coef * ent

:func:`total_loss` does exactly this in one call (and refuses a coefficient without its input).

KL can instead go into the reward, per token: ``token_rewards = kl_penalty_rewards(lp_old, ref_lp, mask,
kl_in_reward_coef, kind)`` passed as ``AdvantageBatch.token_rewards`` (every built-in estimator uses
``token_rewards``; see each estimator's docstring for how). Use one or the other, not both.

**Micro-batch invariance.** When the trainer splits a batch into micro-batches (by rows), it passes the
WHOLE batch's counts, ``global_tokens, global_seqs = batch_counts(full_mask)``, to every micro-batch.
Each micro-batch's loss is then already normalized by the global counts, so the *sum* of micro-batch
losses (and of their gradients) equals the full-batch loss. With ``None``, the micro-batch's own counts
are used (right for an unsplit batch). Under data parallelism the same holds across ranks: pass the counts
of the whole optimizer step's batch (all DP ranks, all micro-batches), and reduce gradients by *sum*;
a DDP wrapper that averages over ``dp_size`` ranks needs the loss multiplied by ``dp_size`` (slime scales
the same way).

This module is import-light (torch is imported inside functions) so that loss plugins may subclass
:class:`PolicyLoss` at module level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_args

from posttrain.core.interfaces import Component

if TYPE_CHECKING:
    import torch

AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)
KLKind = Literal["k1", "k2", "k3", "abs", "k1+", "k3+"]
KL_KINDS: tuple[str, ...] = get_args(KLKind)
LOG_RATIO_LIMIT = 20.0  # |log pi/pi_old| above this is numerically meaningless; exp(20) ~ 5e8


def batch_counts(mask: torch.Tensor) -> tuple[int, int]:
    """``(tokens, sequences)`` of a ``[B, T]`` mask: the normalizers :func:`aggregate` uses.

    ``tokens = sum(mask)``; ``sequences`` = rows with at least one mask token (an empty row is not a
    sequence: it contributes nothing and is not counted). Compute these on the whole batch and pass them
    to every micro-batch as ``global_tokens`` and ``global_seqs``.
    """
    return int(mask.sum().item()), int((mask.sum(-1) > 0).sum().item())


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              global_tokens: Any = None, global_seqs: Any = None,
              max_response_len: int | None = None) -> torch.Tensor:
    """Reduce per-token ``values [B, T]`` to a scalar over ``mask [B, T]``.

    With ``N = global_tokens`` (default ``sum(mask)``), ``S = global_seqs`` (default: rows with a mask
    token), ``n_i = sum_t m_it`` and ``L = max_response_len`` (default ``T``):

    - ``token-mean``: ``sum_it x_it m_it / N`` (every token weighs the same; verl's default, DAPO).
    - ``seq-mean-token-mean``: ``sum_i (sum_t x_it m_it / n_i) / S`` (every sequence weighs the same;
      the original GRPO, GSPO, slime's default).
    - ``seq-mean-token-sum``: ``sum_i sum_t x_it m_it / S``.
    - ``seq-mean-token-sum-norm``: ``sum_i sum_t x_it m_it / (L * S)`` (Dr. GRPO: a constant length
      normalizer, so long and short answers are not reweighted). Pass ``max_response_len`` (the rollout's
      ``max_new_tokens``) so that micro-batches padded to different ``T`` agree. verl leaves out the
      ``1 / S`` (a sum over sequences); here it is a mean, as the name says, so the scale does not grow
      with the batch size.

    Counts are clamped to at least 1, so an all-masked batch gives 0, not NaN.
    """
    import torch

    if mode not in AGGREGATION_MODES:
        from posttrain.core.errors import unknown

        raise ValueError(unknown("aggregation mode", mode, AGGREGATION_MODES))
    if values.shape != mask.shape:
        raise ValueError(f"aggregate: values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape")
    mask = mask.to(values.dtype)
    masked = torch.where(mask > 0, values * mask, 0.0)  # where(): NaN padding must not leak into the sum
    if mode == "token-mean":
        tokens = mask.sum() if global_tokens is None else torch.as_tensor(global_tokens, dtype=values.dtype)
        return masked.sum() / tokens.clamp(min=1)
    lengths = mask.sum(-1)
    seqs = (lengths > 0).sum().to(values.dtype) if global_seqs is None else torch.as_tensor(global_seqs,
                                                                                          dtype=values.dtype)
    per_seq = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / lengths.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / float(max_response_len or values.shape[-1])
    return per_seq.sum() / seqs.clamp(min=1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(x * m) / max(sum(m), 1)``: a scalar (used for metrics, which are micro-batch local).

    Positions outside the mask are dropped, not multiplied by 0, so NaN or inf padding cannot leak in.
    """
    import torch

    values = torch.where(mask > 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return values.sum() / mask.to(values.dtype).sum().clamp(min=1)


def clamped_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                      limit: float = LOG_RATIO_LIMIT) -> torch.Tensor:
    """``clamp(log_probs - old_log_probs, -limit, +limit)`` ``[B, T]`` (the PPO log-ratio, kept finite)."""
    return (log_probs - old_log_probs).clamp(-limit, limit)


def kl_divergence(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3",
                  clamp: float | None = 10.0, old_log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimates ``[B, T]`` from sampled-token log-probs (Schulman's estimators).

    With ``d = log_probs - ref_log_probs``:

    - ``k1 = d`` (unbiased, high variance, can be negative);
    - ``k2 = d^2 / 2`` (biased, low variance; its gradient is the reverse-KL gradient);
    - ``k3 = exp(-d) - 1 + d`` (unbiased, >= 0, low variance; verl's ``low_var_kl``);
    - ``abs = |d|`` (verl's ``abs``);
    - ``k1+``, ``k3+``: the value of ``k1``/``k3`` with the gradient of ``k2`` (straight-through, verl's ``+``
      kinds): ``k2``'s gradient is the unbiased gradient of KL(pi || pi_ref) for on-policy samples, which the
      gradients of ``k1`` and ``k3`` are not.

    ``k3`` is clamped to ``[-clamp, clamp]`` as slime and verl do (``None`` disables); ``d`` is clamped
    to +-20 inside ``k3`` only, so that ``exp`` cannot overflow into a NaN gradient.
    Gradients flow into ``log_probs``; pass a detached ``ref_log_probs``.

    With ``old_log_probs`` (the policy that sampled the tokens), the estimate is multiplied by the
    importance ratio ``exp(log_probs - old_log_probs)`` (with its gradient): an unbiased estimate of
    KL(pi || pi_ref) from off-policy samples (DeepSeek-V3.2; slime's ``--use-unbiased-kl``).
    """
    if kind not in KL_KINDS:
        from posttrain.core.errors import unknown

        raise ValueError(unknown("KL kind", kind, KL_KINDS))
    d = log_probs - ref_log_probs
    base = kind.rstrip("+")
    if base == "k1":
        kl = d
    elif base == "k2":
        kl = 0.5 * d * d
    elif base == "abs":
        kl = d.abs()
    else:
        dc = d.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        kl = (-dc).exp() - 1 + dc
        kl = kl.clamp(-clamp, clamp) if clamp is not None else kl
    if kind.endswith("+"):
        k2 = 0.5 * d * d
        kl = k2 - k2.detach() + kl.detach()
    if old_log_probs is not None:
        kl = kl * clamped_log_ratio(log_probs, old_log_probs.detach()).exp()
    return kl


def kl_penalty_rewards(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor,
                       coef: float, kind: str = "k1") -> torch.Tensor:
    """Dense per-token rewards ``-coef * KL_t * m_t`` ``[B, T]`` for ``AdvantageBatch.token_rewards``
    (KL in the reward, the classic RLHF-PPO shaping). Computed without gradient."""
    import torch

    with torch.no_grad():
        return -coef * kl_divergence(log_probs, ref_log_probs, kind) * mask.to(log_probs.dtype)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v``: ``logits [B, T, V]`` -> ``[B, T]``.

    For large vocabularies the trainer computes entropy chunked alongside the log-probs; this is the
    reference formula (and the one to call on a small chunk).
    """
    import torch

    logits = logits.float()
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = 0.2, mode: str = "token-mean", global_tokens: Any = None,
               global_seqs: Any = None, max_response_len: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's clipped value loss (PPO): ``0.5 * max((V - R)^2, (V_clip - R)^2)`` aggregated by ``mode``.

    ``V_clip = V_old + clip(V - V_old, -clip, +clip)``; ``clip=None`` gives the plain ``0.5 (V - R)^2``.
    All inputs ``[B, T]``; ``returns`` come from a critic estimator (GAE), ``old_values`` from the critic
    before this update. Metrics: ``vf_clipfrac`` (tokens where the clipped term is the larger),
    ``vf_loss``, ``value_mean``. Returns ``(scalar loss, metrics)``.
    """
    import torch

    on = mask > 0  # zero the padding first, so that NaN there reaches neither the loss nor the gradient
    values = torch.where(on, values, 0.0)
    old_values, returns = torch.where(on, old_values.detach(), 0.0), torch.where(on, returns.detach(), 0.0)
    unclipped = (values - returns) ** 2
    if clip is None:
        per_token, clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        clipped_sq = (v_clip - returns) ** 2
        per_token, clipped = torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
    loss = aggregate(0.5 * per_token, mask, mode, global_tokens, global_seqs, max_response_len)
    with torch.no_grad():
        metrics = {"vf_loss": float(loss.item()), "vf_clipfrac": float(masked_mean(clipped.float(), mask).item()),
                   "value_mean": float(masked_mean(values.float(), mask).item())}
    return loss, metrics


class PolicyLoss(Component):
    """Base of the policy losses: shape checks, IS weights, aggregation and the common metrics.

    A subclass sets ``name``, a ``Config`` with at least ``aggregation`` and ``max_response_len`` and
    implements :meth:`token_losses`. Call::

        loss, metrics = loss_fn(log_probs, old_log_probs, advantages, response_mask,
                                is_weights=None, global_tokens=None, global_seqs=None)

    ``log_probs`` (with gradient), ``old_log_probs``, ``advantages``, ``response_mask``, ``is_weights``:
    all ``[B, T]``. Per-token losses are multiplied by ``is_weights`` (detached; from a rollout/training
    mismatch correction), then reduced with :func:`aggregate`. ``metrics`` are floats over this
    micro-batch's tokens: ``pg_loss``, ``clipfrac``, ``approx_kl`` (``k3`` of pi_old against pi, >= 0),
    ``ratio_mean``, and any other flag fractions the subclass reports.
    """

    name = ""

    def token_losses(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(per_token_loss, ratio, flags)``: the ``[B, T]`` loss before IS weights and aggregation, the
        ``[B, T]`` ratio reported as ``ratio_mean``, and ``{metric: bool [B, T]}`` whose masked means become
        metrics (at least ``clipfrac``: tokens whose gradient or weight was clipped)."""
        raise NotImplementedError

    def __call__(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, is_weights: torch.Tensor | None = None, global_tokens: Any = None,
                 global_seqs: Any = None) -> tuple[torch.Tensor, dict[str, float]]:
        import torch

        named = {"old_log_probs": old_log_probs, "advantages": advantages, "response_mask": response_mask}
        if is_weights is not None:
            named["is_weights"] = is_weights
        for key, tensor in named.items():
            if tensor.shape != log_probs.shape:
                raise ValueError(f"{self.name}: {key} has shape {tuple(tensor.shape)}, log_probs "
                                 f"{tuple(log_probs.shape)}; all must be [B, T]")
        # fp32 math whatever the inputs (bf16 sums over millions of tokens lose the gradient's scale)
        mask = response_mask.float()
        # padding may hold anything (NaN, -inf): zero it before any arithmetic, or a NaN on a padded token
        # would reach the gradient through 0 * NaN in the backward pass
        on = mask > 0
        log_probs = torch.where(on, log_probs.float(), 0.0)
        old_log_probs = torch.where(on, old_log_probs.detach().float(), 0.0)
        advantages = torch.where(on, advantages.detach().float(), 0.0)
        per_token, ratio, flags = self.token_losses(log_probs, old_log_probs, advantages, mask)
        if is_weights is not None:
            per_token = per_token * torch.where(on, is_weights.detach().float(), 0.0)
        per_token = torch.where(on, per_token, 0.0)
        loss = aggregate(per_token, mask, self.config.aggregation, global_tokens, global_seqs,
                         self.config.max_response_len)
        with torch.no_grad():
            n = mask.sum().clamp(min=1)
            d = clamped_log_ratio(log_probs.detach(), old_log_probs)  # k3 of pi_old vs pi: e^d - 1 - d
            metrics = {
                "pg_loss": float(loss.item()),
                "approx_kl": float(masked_mean(d.exp() - 1 - d, mask)),
                "ratio_mean": float(masked_mean(ratio.detach(), mask)),
            }
            metrics.update({key: float((flag & on).sum() / n) for key, flag in flags.items()})
        return loss, metrics


def total_loss(pg_loss: torch.Tensor, response_mask: torch.Tensor, *, log_probs: torch.Tensor | None = None,
               ref_log_probs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
               kl_loss_coef: float = 0.0, kl_kind: str = "k3", entropy_coef: float = 0.0,
               old_log_probs: torch.Tensor | None = None,
               aggregation: str = "token-mean", global_tokens: Any = None, global_seqs: Any = None,
               max_response_len: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``total = pg_loss + kl_loss_coef * kl - entropy_coef * ent``: the trainer's one call per micro-batch.

    ``kl = aggregate(kl_divergence(log_probs, ref_log_probs, kl_kind), ...)`` and
    ``ent = aggregate(entropy, ...)`` use the policy loss's ``aggregation`` and the same global counts, so
    the total stays micro-batch invariant. With ``old_log_probs`` the KL term is importance-weighted
    (the unbiased off-policy form, see :func:`kl_divergence`). A coefficient that is set without its input
    raises (a KL term is never silently dropped); an input given with a zero coefficient is still measured
    and reported.
    Metrics: ``kl_loss`` and ``entropy`` (each only when its input is given), ``total_loss``.
    All tensors ``[B, T]`` except ``pg_loss`` (a scalar).
    """
    import torch

    if kl_loss_coef and (log_probs is None or ref_log_probs is None):
        raise ValueError(f"kl_loss_coef={kl_loss_coef} needs log_probs and ref_log_probs (the reference model's)")
    if entropy_coef and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs the per-token entropy [B, T]")
    counts = dict(global_tokens=global_tokens, global_seqs=global_seqs, max_response_len=max_response_len)
    total, metrics = pg_loss, {}
    if log_probs is not None and ref_log_probs is not None:
        on = response_mask > 0  # zero the padding first: NaN there must not reach the gradient
        log_probs, ref_log_probs = torch.where(on, log_probs, 0.0), torch.where(on, ref_log_probs.detach(), 0.0)
        if old_log_probs is not None:
            old_log_probs = torch.where(on, old_log_probs.detach(), 0.0)
        per_token = kl_divergence(log_probs, ref_log_probs, kl_kind, old_log_probs=old_log_probs)
        kl = aggregate(per_token, response_mask, aggregation, **counts)
        metrics["kl_loss"] = float(kl.detach().item())
        if kl_loss_coef:
            total = total + kl_loss_coef * kl
    if entropy is not None:
        ent = aggregate(torch.where(response_mask > 0, entropy, 0.0), response_mask, aggregation, **counts)
        metrics["entropy"] = float(ent.detach().item())
        if entropy_coef:
            total = total - entropy_coef * ent
    with torch.no_grad():
        metrics["total_loss"] = float(total.item())
    return total, metrics


def mismatch_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                     is_weights: torch.Tensor, masked: torch.Tensor, clipped: torch.Tensor) -> dict[str, float]:
    """Metrics every rollout/training mismatch correction reports (means over the masked tokens).

    ``train_rollout_logprob_abs_diff`` = mean ``|train - rollout|``; ``is_weight_mean``; ``is_masked_frac``
    (tokens whose weight was set to 0 for being out of bounds); ``is_clipped_frac`` (tokens whose weight
    was truncated to a bound); ``is_ratio_mean`` (the raw token ratio ``exp(train - rollout)``).
    """
    import torch

    with torch.no_grad():
        d = clamped_log_ratio(train_log_probs.detach(), rollout_log_probs.detach())
        return {
            "train_rollout_logprob_abs_diff": float(masked_mean(d.abs(), mask).item()),
            "is_weight_mean": float(masked_mean(is_weights.float(), mask).item()),
            "is_masked_frac": float(masked_mean(masked.float(), mask).item()),
            "is_clipped_frac": float(masked_mean(clipped.float(), mask).item()),
            "is_ratio_mean": float(masked_mean(d.exp(), mask).item()),
        }
