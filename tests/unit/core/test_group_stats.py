"""``group_max_at_k`` against an enumeration of every k-subset, and its closed forms at the edges."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest
import torch

from posttrain.core.group_stats import group_max_at_k


def enumerated(rewards: list[float], k: int) -> tuple[list[float], float, float]:
    """``(with_i, mean, std)`` of one group by listing its k-subsets (k clipped to the group size)."""
    k = min(k, len(rewards))
    subsets = list(itertools.combinations(range(len(rewards)), k))
    best = {s: max(rewards[j] for j in s) for s in subsets}
    mean = statistics.fmean(best.values())
    std = statistics.pstdev(best.values())
    with_i = [statistics.fmean(best[s] for s in subsets if i in s) for i in range(len(rewards))]
    return with_i, mean, std


def test_matches_the_enumeration_of_subsets_on_random_layouts():
    rng = random.Random(0)
    for _ in range(60):
        groups = [g for g in range(rng.randint(1, 4)) for _ in range(rng.randint(1, 7))]
        rng.shuffle(groups)  # interleaved ids, uneven sizes, singletons
        rewards = [rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0]) for _ in groups]  # ties on purpose
        k = rng.randint(1, 8)
        with_i, mean, std = group_max_at_k(torch.tensor(rewards), torch.tensor(groups) * 5 + 3, k)
        for g in set(groups):
            members = [i for i, h in enumerate(groups) if h == g]
            want_with, want_mean, want_std = enumerated([rewards[i] for i in members], k)
            torch.testing.assert_close(with_i[members], torch.tensor(want_with), atol=1e-6, rtol=0)
            torch.testing.assert_close(mean[members], torch.full((len(members),), want_mean), atol=1e-6, rtol=0)
            torch.testing.assert_close(std[members], torch.full((len(members),), want_std), atol=1e-6, rtol=0)


def test_pass_at_k_of_binary_rewards_in_closed_form():
    # 1 correct of 4, k = 2: p = 1 - C(3,2)/C(4,2) = 1/2; the correct sample is in a passing pair always, a
    # wrong one in a passing pair 1 time of C(3,1) = 3
    with_i, mean, std = group_max_at_k(torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long), 2)
    torch.testing.assert_close(with_i, torch.tensor([1 / 3, 1.0, 1 / 3, 1 / 3]))
    torch.testing.assert_close(mean, torch.full((4,), 0.5))
    torch.testing.assert_close(std, torch.full((4,), 0.5))


def test_k_one_is_the_reward_and_k_at_least_the_size_is_the_max():
    rewards, groups = torch.tensor([3.0, -1.0, 2.0, 5.0]), torch.tensor([0, 0, 0, 1])
    with_i, mean, std = group_max_at_k(rewards, groups, 1)
    torch.testing.assert_close(with_i, rewards)
    torch.testing.assert_close(mean, torch.tensor([4 / 3, 4 / 3, 4 / 3, 5.0]))
    torch.testing.assert_close(std[:3], torch.full((3,), statistics.pstdev([3.0, -1.0, 2.0])))
    with_i, mean, std = group_max_at_k(rewards, groups, 3)
    torch.testing.assert_close(with_i, torch.tensor([3.0, 3.0, 3.0, 5.0]))
    torch.testing.assert_close(mean, with_i)
    torch.testing.assert_close(std, torch.zeros(4))


def test_k_below_one_is_refused():
    with pytest.raises(ValueError, match="k must be >= 1"):
        group_max_at_k(torch.tensor([1.0]), torch.tensor([0]), 0)
