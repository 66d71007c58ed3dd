"""The reward contract: finite scores in the documented shape, sync or async, and the author's cases."""

from __future__ import annotations

import asyncio
import inspect
import math

import pytest

from posttrain.testing.contracts.common import ComponentContract


def score_of(result) -> float:
    """The ``score`` of a reward result (a float, or a dict with the key ``"score"``)."""
    if isinstance(result, dict):
        assert "score" in result, f"a reward dict needs the key 'score', got {sorted(result)}"
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in result.values()), result
        return float(result["score"])
    assert isinstance(result, (int, float)) and not isinstance(result, bool), f"got {result!r}"
    return float(result)


def call_reward(reward, arg):
    out = reward(arg)
    return asyncio.run(out) if inspect.isawaitable(out) else out


class RewardContract(ComponentContract):
    """Supply a ``reward`` fixture; override ``reward_cases`` with ``[(Sample, expected_score), ...]``."""

    @pytest.fixture
    def component(self, reward):
        return reward

    @pytest.fixture
    def reward_cases(self):
        """``[(Sample, expected_score)]``; the default is one generic sample with no expectation."""
        from posttrain.core.types import Sample

        return [(Sample(prompt="What is 1+1?", response="2", label="2", metadata={}), None)]

    def test_scope_is_declared(self, reward):
        assert getattr(reward, "scope", "sample") in ("sample", "group")

    def test_scores_are_finite_and_match_cases(self, reward, reward_cases):
        for sample, expected in reward_cases:
            if getattr(reward, "scope", "sample") == "group":
                results = call_reward(reward, [sample])
                assert len(results) == 1
                score = score_of(results[0])
            else:
                score = score_of(call_reward(reward, sample))
            assert math.isfinite(score)
            if expected is not None:
                assert score == pytest.approx(expected), f"{sample.response!r} vs {sample.label!r}"
