"""Per-group statistics over samples that share a ``group_index`` (groups need not be contiguous)."""

from __future__ import annotations

import torch


def check_finite(rewards: torch.Tensor) -> torch.Tensor:
    """``rewards [B]`` as float32; a NaN or inf reward raises ``ValueError`` naming the sample index."""
    rewards = rewards.float()
    bad = (~torch.isfinite(rewards)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"reward of sample {i} is {rewards[i].item()} (non-finite rewards: {bad.tolist()[:10]})")
    return rewards


def group_mean_std(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group mean and Bessel-corrected std broadcast back to each sample: two ``[B]`` tensors.

    A group of one sample gets mean 0 and std 1, so standardizing leaves its value unchanged.
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, inverse, torch.ones_like(values))
    mean = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, inverse, values) / count
    sq = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, inverse, (values - mean[inverse]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    single = count[inverse] == 1
    mean_b, std_b = mean[inverse], std[inverse]
    return torch.where(single, torch.zeros_like(mean_b), mean_b), torch.where(single, torch.ones_like(std_b), std_b)
