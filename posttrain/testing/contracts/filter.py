"""The dynamic-sampling filter contract: keep (None) or a short reason, no mutation, failed samples tolerated."""

from __future__ import annotations

import copy

import pytest

from posttrain.testing.contracts.common import ComponentContract


def rewarded_group(rewards, status="completed"):
    """A completed group with the given rewards (``None`` = a failed sample)."""
    from posttrain.core.types import Sample, SampleStatus

    return [Sample(prompt="p", response=f"r{i}", label="1", reward=r, group_index=3, index=i,
                   status=SampleStatus.FAILED if r is None else SampleStatus(status),
                   reward_parts={} if r is None else {"x": r})
            for i, r in enumerate(rewards)]


GROUPS = [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.5, None, 0.25, None],
          [None, None], [1.0], [-1.0, 2.0]]


class FilterContract(ComponentContract):
    """Supply a ``filter_`` fixture (a filter instance)."""

    @pytest.fixture
    def component(self, filter_):
        return filter_

    def test_returns_none_or_a_short_reason(self, filter_):
        for rewards in GROUPS:
            reason = filter_(rewarded_group(rewards))
            assert reason is None or (isinstance(reason, str) and 0 < len(reason) <= 64 and "/" not in reason), \
                f"{rewards}: a filter returns None (keep) or a short reason without '/' (a metric name part)"

    def test_does_not_mutate_the_group(self, filter_):
        for rewards in GROUPS:
            group = rewarded_group(rewards)
            before = copy.deepcopy(group)
            filter_(group)
            assert group == before, "filters decide; they must not change the samples"

    def test_is_deterministic(self, filter_):
        for rewards in GROUPS:
            assert filter_(rewarded_group(rewards)) == filter_(rewarded_group(rewards))
