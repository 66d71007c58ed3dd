"""RewardRunner: weighted composition, async concurrency, the process pool, contained failures."""

import logging
import os

import pytest

from posttrain.core.selection import Selection
from posttrain.core.errors import UsageError
from posttrain.core.plugins import load_plugins
from posttrain.core.rewards import RewardError, RewardRunner
from posttrain.core.types import Sample, SampleStatus

from tests.unit.core.reward_helpers import Boom, Die, GroupRank, Pid, SlowAsync


@pytest.fixture(scope="module")
def plugins():
    p = load_plugins()
    for cls in (Boom, Pid, SlowAsync, GroupRank, Die):
        p.rewards.add(cls)
    return p


def comp(plugins, name, weight=1.0, **config):
    cls = plugins.rewards[name]
    return Selection("rewards", name, cls.Config(**config), weight)


def groups_of(responses, label="4", size=2):
    samples = [Sample(prompt="q", response=r, label=label, index=i, group_index=i // size, response_length=len(r))
               for i, r in enumerate(responses)]
    return [samples[i:i + size] for i in range(0, len(samples), size)]


async def test_weighted_sum_and_parts(plugins):
    runner = RewardRunner([comp(plugins, "math", 1.0), comp(plugins, "overlong", 0.5, max_len=12, buffer=2)],
                          plugins)
    groups = groups_of([r"\boxed{4}", r"\boxed{5} ....... long"])
    metrics = await runner.score_groups(groups)
    a, b = groups[0]
    assert a.reward == 1.0 and a.reward_parts == {"math": 1.0, "math/format_ok": 1.0, "overlong": 0.0}
    assert b.reward_parts["overlong"] == -1.0 and b.reward == pytest.approx(-0.5)
    assert metrics["reward/math"] == 0.5 and metrics["reward/overlong"] == -0.5
    assert metrics["reward/math/format_ok"] == 1.0
    assert metrics["reward/total"] == pytest.approx(0.25) and metrics["reward/failed"] == 0.0


async def test_failures_are_contained_and_logged(plugins, caplog):
    runner = RewardRunner([comp(plugins, "boom"), comp(plugins, "length", per_token=0.0)], plugins)
    groups = groups_of(["ok", "boom", "nan", "inf", "str", "ok"])
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards"):
        metrics = await runner.score_groups(groups)
    flat = [s for g in groups for s in g]
    assert [s.status for s in flat] == [SampleStatus.PENDING] + [SampleStatus.FAILED] * 4 + [SampleStatus.PENDING]
    assert flat[1].error == "reward boom: ValueError: kaboom" and flat[1].reward is None
    assert "not a finite number" in flat[2].error and "not a finite number" in flat[3].error
    assert "not a number" in flat[4].error
    assert flat[1].reward_parts == {"length": 0.0}  # the parts that worked are kept
    assert metrics["reward/failed"] == 4.0 and flat[0].reward == 1.0
    assert "sample 1 (group 0): reward boom: ValueError: kaboom" in caplog.text


async def test_on_error_raise_stops(plugins):
    runner = RewardRunner([comp(plugins, "boom")], plugins, on_error="raise")
    with pytest.raises(RewardError, match="sample 1 .*kaboom"):
        await runner.score_groups(groups_of(["ok", "boom"]))
    with pytest.raises(UsageError, match="on_error"):
        RewardRunner([], plugins, on_error="ignore")


async def test_async_rewards_run_concurrently_within_the_bound(plugins):
    SlowAsync.max_in_flight = 0
    runner = RewardRunner([comp(plugins, "slow_async")], plugins, concurrency=4)
    groups = groups_of(["x"] * 20)
    metrics = await runner.score_groups(groups)
    assert SlowAsync.max_in_flight == 4
    assert all(s.reward == 0.5 and s.reward_parts["slow_async/latency"] == 0.02 for g in groups for s in g)
    assert metrics["reward/slow_async"] == 0.5


async def test_group_rewards_and_skipped_samples(plugins):
    runner = RewardRunner([comp(plugins, "group_rank"), comp(plugins, "group_rank", 2.0)], plugins)
    groups = groups_of(["a", "b", "c", "short", "x", "y"], size=3)
    groups[1][2].status = SampleStatus.ABORTED
    await runner.score_groups(groups)
    assert [s.reward_parts.get("group_rank") for s in groups[0]] == [0.0, 0.5, 1.0]
    assert [s.reward for s in groups[0]] == [0.0, 1.5, 3.0]  # weights 1 and 2 on "group_rank#2"
    assert "group_rank#2" in groups[0][0].reward_parts
    assert all(s.status == SampleStatus.FAILED for s in groups[1][:2])
    assert "returned list of length 1 for 2 samples" in groups[1][0].error
    assert groups[1][2].status == SampleStatus.ABORTED and groups[1][2].reward is None


@pytest.mark.slow
async def test_process_pool_runs_sync_rewards_elsewhere(plugins):
    with RewardRunner([comp(plugins, "pid"), comp(plugins, "math", 0.0), comp(plugins, "boom", 0.0),
                       comp(plugins, "slow_async", 0.0)], plugins, workers=2) as runner:
        groups = groups_of([r"\boxed{4}", r"\boxed{4.0}", "boom", "ok"] * 4)
        metrics = await runner.score_groups(groups)
    flat = [s for g in groups for s in g]
    pids = {s.reward_parts["pid"] for s in flat}
    assert float(os.getpid()) not in pids and 1 <= len(pids) <= 2
    assert [s.reward_parts.get("math") for s in flat[:4]] == [1.0, 1.0, 0.0, 0.0]
    assert sum(s.status == SampleStatus.FAILED for s in flat) == 4 and "kaboom" in flat[2].error
    assert metrics["reward/failed"] == 4.0 and flat[0].reward_parts["slow_async"] == 0.5


@pytest.mark.slow
async def test_a_dying_worker_fails_only_its_chunk_and_the_pool_recovers(plugins):
    with RewardRunner([comp(plugins, "die")], plugins, workers=2) as runner:
        groups = groups_of(["ok"] * 15 + ["die"], size=4)  # 16 samples -> 8 chunks of 2
        metrics = await runner.score_groups(groups)
        flat = [s for g in groups for s in g]
        assert metrics["reward/failed"] == 2.0  # the chunk holding "die" (and its neighbour)
        assert all(s.reward == 1.0 for s in flat[:14])
        assert "worker process died" in flat[15].error
        again = groups_of(["ok"] * 4)
        assert (await runner.score_groups(again))["reward/failed"] == 0.0


async def test_async_calls_past_the_timeout_fail_the_sample(plugins):
    runner = RewardRunner([comp(plugins, "slow_async", delay=5.0)], plugins, timeout=0.05)
    groups = groups_of(["x", "y"])
    metrics = await runner.score_groups(groups)
    assert metrics["reward/failed"] == 2.0
    assert groups[0][0].error == "reward slow_async: timed out after 0.05s (reward_runner.timeout)"
