"""The reward contract: finite scores in the documented shape, sync or async, and the author's cases.

Cases come from the ``reward_cases`` fixture; its default asks the reward for ``contract_cases()``
(a static method returning ``[(Sample, expected_score or None)]``) and otherwise uses one generic
math-like sample. Every reward must also survive the reward runner: pickled to worker processes,
called concurrently, with the same scores as a direct call.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import pickle

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
    if inspect.isawaitable(out):
        async def finish():
            try:
                return await out
            finally:
                closer = getattr(reward, "aclose", None)
                if closer is not None:
                    await closer()
        return asyncio.run(finish())
    return out


class RewardContract(ComponentContract):
    """Supply a ``reward`` fixture; override ``reward_cases`` with ``[(Sample, expected_score), ...]``
    (or give the reward a static ``contract_cases()``)."""

    @pytest.fixture
    def component(self, reward):
        return reward

    @pytest.fixture
    def reward_cases(self, reward):
        """``[(Sample, expected_score)]``: the reward's ``contract_cases()``, else one generic sample."""
        from posttrain.core.types import Sample

        cases = getattr(reward, "contract_cases", None)
        if callable(cases):
            return cases()
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

    def test_picklable_for_worker_processes(self, reward):
        """``reward_runner.workers > 1`` sends the reward instance to spawned processes by pickle."""
        clone = pickle.loads(pickle.dumps(reward))
        assert type(clone) is type(reward) and clone.config == reward.config

    def test_runner_scores_match_direct_calls(self, reward, reward_cases):
        """Through ``RewardRunner`` (all cases at once, concurrently) the scores equal direct calls."""
        import copy

        from posttrain.core.rewards import RewardRunner

        class _One:  # a Selection stand-in that hands over this very instance
            kind, name, weight, config = "rewards", type(reward).name, 1.0, reward.config

            def create(self, plugins):
                return reward

        samples = [copy.deepcopy(sample) for sample, _ in reward_cases]
        for i, s in enumerate(samples):
            s.index, s.group_index = i, i
        runner = RewardRunner([_One()], plugins=None, concurrency=8)

        async def go():
            try:
                return await runner.score_groups([[s] for s in samples])
            finally:
                await runner.aclose()
        metrics = asyncio.run(go())
        assert metrics["reward/failed"] == 0, [s.error for s in samples]
        for s, (_, expected) in zip(samples, reward_cases):
            assert math.isfinite(s.reward)
            if expected is not None:
                assert s.reward == pytest.approx(expected)
