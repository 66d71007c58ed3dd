"""Per-group and per-batch statistics for advantage estimators.

A *group* is the set of samples that share a ``group_index`` (an id, not a position: groups need not be
contiguous, and their sizes may differ after filtering or fan-out). Everything here works on ``[B]``
per-sample tensors or ``[B, T]`` per-token tensors with a ``[B, T]`` response mask, and never mutates
its inputs. Estimator authors: start ``advantages()`` with :func:`check_batch` (or :func:`sequence_scores`)
to get the input checks every built-in makes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from posttrain.core.types import AdvantageBatch


def check_finite(rewards: torch.Tensor, what: str = "reward") -> torch.Tensor:
    """``rewards [B]`` (or ``[B, T]``) as float32; a NaN or inf raises ``ValueError`` naming the sample index."""
    rewards = rewards.float()
    rows = rewards.unsqueeze(-1) if rewards.dim() == 1 else rewards.flatten(1)
    bad_rows = (~torch.isfinite(rows)).any(-1).nonzero().flatten()
    if bad_rows.numel():
        i = int(bad_rows[0])
        row = rewards[i]
        value = row.item() if row.dim() == 0 else row[~torch.isfinite(row)][0].item()
        raise ValueError(f"{what} of sample {i} is {value} (samples with non-finite {what}s: "
                         f"{bad_rows.tolist()[:10]})")
    return rewards


def group_inverse(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(inverse [B], n_groups)``: ``inverse[i]`` is the dense group number (0..n_groups-1) of sample ``i``."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    return inverse, (int(inverse.max()) + 1 if inverse.numel() else 0)


def group_sum_count(values: torch.Tensor, group_index: torch.Tensor,
                    weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``(sum_g w*v, sum_g w)`` of each sample's group, broadcast back: two ``[B]`` tensors.

    ``weights`` defaults to 1, so the second tensor is then the group size ``n_g``.
    """
    inverse, n = group_inverse(group_index)
    w = torch.ones_like(values) if weights is None else weights.to(values.dtype)
    total = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, inverse, values * w)
    count = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, inverse, w)
    return total[inverse], count[inverse]


def group_mean_std(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group mean and Bessel-corrected std broadcast back to each sample: two ``[B]`` tensors.

    ``mean_g = sum_g r / n_g``; ``std_g = sqrt(sum_g (r - mean_g)^2 / (n_g - 1))``.
    A group of one sample gets mean 0 and std 1, so standardizing leaves its value unchanged.
    """
    inverse, n_groups = group_inverse(group_index)
    def per_group_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, x)

    count = per_group_sum(torch.ones_like(values))
    mean = per_group_sum(values) / count
    sq = per_group_sum((values - mean[inverse]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    single = count[inverse] == 1
    mean_b, std_b = mean[inverse], std[inverse]
    return torch.where(single, torch.zeros_like(mean_b), mean_b), torch.where(single, torch.ones_like(std_b), std_b)


def _comb_ratio(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``C(a, b) / C(c, d)`` elementwise in float64 (``C(a, b) = 0`` unless ``0 <= b <= a``; ``C(c, d) > 0``)."""
    def log_comb(n, k):
        return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)

    valid = (b >= 0) & (b <= a)
    a_, b_ = torch.where(valid, a, 0.0), torch.where(valid, b, 0.0)
    return torch.where(valid, (log_comb(a_, b_) - log_comb(c, d)).exp(), 0.0)


def group_max_at_k(values: torch.Tensor, group_index: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The max@k of each group (pass@k for 0/1 rewards) and each sample's share of it: three ``[B]`` tensors
    ``(with_i, mean_g, std_g)``, broadcast back to the samples.

    With ``S`` a uniformly random ``k``-subset of sample ``i``'s group ``g`` (``n_g`` samples; ``k`` is
    clipped to ``n_g``) and ``M_S = max_{j in S} r_j``::

        mean_g = E_S[M_S]                    std_g = sqrt(E_S[M_S^2] - mean_g^2)
        with_i = E_S[M_S | i in S]

    computed in closed form on the group's rewards sorted ascending, ``v_1 <= ... <= v_n`` (``i`` at place
    ``j``): ``P(M_S = v_j) = C(j-1, k-1) / C(n, k)``, and given ``i in S`` the other ``k - 1`` members are a
    random subset of the other ``n - 1``, so
    ``with_j = v_j C(j-1, k-1) / C(n-1, k-1) + sum_{m > j} v_m C(m-2, k-2) / C(n-1, k-1)``.
    Tied rewards get equal values whatever their order. At ``k = 1``: ``with_i = r_i``, the group mean and the
    population std; at ``k >= n_g``: every ``with_i = mean_g = max_g`` and ``std_g = 0``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    v = values.double()
    inverse, n_groups = group_inverse(group_index)
    order = torch.argsort(v, stable=True)
    order = order[torch.argsort(inverse[order], stable=True)]  # by group, ascending reward within a group
    g, vs = inverse[order], v[order]
    size = torch.zeros(n_groups, dtype=torch.float64, device=v.device).index_add_(0, inverse, torch.ones_like(v))
    end = size.cumsum(0)  # one past each group's last sorted place
    n = size[g]
    j = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device) - (end - size)[g]  # 1-based place
    kk = torch.clamp(n, max=float(k))
    weight = _comb_ratio(j - 1, kk - 1, n, kk)  # P(M_S = v_j)

    def per_group(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_groups, dtype=torch.float64, device=v.device).index_add_(0, g, x)

    mean = per_group(weight * vs)
    var = (per_group(weight * vs * vs) - mean * mean).clamp(min=0)
    # m-th term of the tail: v_m C(m-2, k-2) / C(n-1, k-1) (0 at m = 1); with_j sums the terms of places m > j
    term = torch.where(n > 1, vs * _comb_ratio(j - 2, kk - 2, n - 1, kk - 1), 0.0)
    cum = term.cumsum(0)
    tail = cum[(end[g] - 1).long()] - cum
    own = torch.where(n > 1, _comb_ratio(j - 1, kk - 1, n - 1, kk - 1), 1.0)
    with_sorted = vs * own + tail
    with_i = torch.empty_like(v).index_copy_(0, order, with_sorted)
    dtype = values.dtype if values.is_floating_point() else torch.float32
    return with_i.to(dtype), mean[inverse].to(dtype), var.sqrt()[inverse].to(dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Whiten ``values [B, T]`` over the tokens where ``mask [B, T]`` is 1; 0 elsewhere.

    ``(x - mu) / sqrt(var + eps)`` with ``mu`` and the Bessel-corrected ``var`` taken over masked tokens
    (verl's and slime's ``masked_whiten``); ``shift_mean=False`` adds ``mu`` back (scale only).
    With a single masked token the variance is taken as 0 (nothing to compare it with).
    """
    mask = mask.to(values.dtype)
    n = mask.sum()
    mean = (values * mask).sum() / n.clamp(min=1)
    var = (((values - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` position of the last token with ``mask [B, T]`` = 1 in each row (0 for an empty row)."""
    t = mask.shape[-1]
    positions = torch.arange(t, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.zeros_like(positions)).amax(-1)


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor,
                          token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` per-token rewards: the outcome ``rewards [B]`` on each row's last response token, plus the
    optional dense ``token_rewards [B, T]``, all times ``mask``. A row with no response tokens gets 0."""
    out = torch.zeros_like(mask, dtype=torch.float32)
    has_tokens = mask.sum(-1) > 0
    out.scatter_(1, last_token_index(mask).unsqueeze(-1), (rewards * has_tokens).unsqueeze(-1).float())
    if token_rewards is not None:
        out = out + token_rewards.float()
    return out * mask


def discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_{k >= 0} gamma^k r_{t+k}`` along the last dimension of ``token_rewards [B, T]``.

    A reverse scan over positions (every position counts one step, including masked ones: callers
    pass rewards that are already 0 outside the mask). ``gamma = 1`` is a reverse cumulative sum.
    """
    if gamma == 1.0:
        return token_rewards.flip(-1).cumsum(-1).flip(-1)
    rewards_tb = token_rewards.T.contiguous()  # [T, B]: each step of the scan reads one contiguous row
    out = torch.empty_like(rewards_tb)
    running = torch.zeros_like(rewards_tb[0])
    for t in range(rewards_tb.shape[0] - 1, -1, -1):
        running = rewards_tb[t] + gamma * running
        out[t] = running
    return out.T


def check_batch(batch: AdvantageBatch, needs_values: bool = False) -> torch.Tensor:
    """Validate shapes and finiteness; return the rewards ``[B]`` as float32.

    A NaN or inf in ``rewards``, ``token_rewards`` or ``values`` raises ``ValueError`` naming the sample.
    """
    b = batch.response_mask.shape[0]
    if batch.response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(batch.response_mask.shape)}")
    if tuple(batch.rewards.shape) != (b,) or tuple(batch.group_index.shape) != (b,):
        raise ValueError(f"rewards {tuple(batch.rewards.shape)} and group_index {tuple(batch.group_index.shape)} "
                         f"must be [B] with B = {b} (response_mask rows)")
    for key in ("token_rewards", "values"):
        tensor = getattr(batch, key)
        if tensor is not None:
            if tensor.shape != batch.response_mask.shape:
                raise ValueError(f"{key} has shape {tuple(tensor.shape)}, response_mask "
                                 f"{tuple(batch.response_mask.shape)}")
            # padding may hold anything: only tokens under the mask must be finite
            check_finite(torch.where(batch.response_mask > 0, tensor.float(), 0.0), what=key.rstrip("s"))
    if needs_values and batch.values is None:
        raise ValueError("this estimator needs critic values: AdvantageBatch.values [B, T] is None")
    return check_finite(batch.rewards)


def masked_token_rewards(batch: AdvantageBatch) -> torch.Tensor | None:
    """``token_rewards [B, T]`` as float32 with 0 outside the mask (whatever padding held), or None."""
    if batch.token_rewards is None:
        return None
    return torch.where(batch.response_mask > 0, batch.token_rewards.float(), 0.0)


def sequence_scores(batch: AdvantageBatch) -> torch.Tensor:
    """``[B]`` outcome reward plus the sum of the masked ``token_rewards`` of each sample."""
    rewards = check_batch(batch)
    token_rewards = masked_token_rewards(batch)
    if token_rewards is not None:
        rewards = rewards + token_rewards.sum(-1)
    return rewards
