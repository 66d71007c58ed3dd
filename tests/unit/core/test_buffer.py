"""DataBuffer (groups, epochs, shuffling, resume, returned groups) and dynamic sampling."""

import asyncio
import json

import pytest

from posttrain.core.buffer import DataBuffer, DataExhausted, apply_filters, collect_groups
from posttrain.core.data import PromptRow
from posttrain.core.plugins import load_plugins
from posttrain.core.types import Sample, SampleStatus

ROWS = [PromptRow(prompt=f"p{i}", label=str(i), metadata={"i": i}) for i in range(10)]
NonzeroStd = load_plugins().filters["nonzero_std"]


def prompts(groups):
    return [g[0].prompt for g in groups]


def test_groups_share_a_unique_index_and_fresh_samples():
    buf = DataBuffer(ROWS, n_samples_per_prompt=3, seed=1)
    groups = buf.next_groups(4)
    assert all(len(g) == 3 and len({s.group_index for s in g}) == 1 for g in groups)
    assert len({g[0].group_index for g in groups}) == 4
    assert [s.index for g in groups for s in g] == list(range(12))
    groups[0][0].metadata["i"] = 99  # samples are copies: the dataset is untouched
    assert ROWS[int(groups[0][1].label)].metadata["i"] != 99 and groups[0][1].metadata["i"] != 99


def test_shuffle_per_epoch_and_exhaustion():
    buf = DataBuffer(ROWS, 1, seed=5, epochs=2)
    first, second = prompts(buf.next_groups(10)), prompts(buf.next_groups(10))
    assert sorted(first) == sorted(second) == sorted(r.prompt for r in ROWS)
    assert first != second and first != [r.prompt for r in ROWS]  # seed + epoch differs per epoch
    assert buf.exhausted and buf.next_groups(3) == []
    same = DataBuffer(ROWS, 1, seed=5, epochs=2)
    assert prompts(same.next_groups(10)) == first
    assert prompts(DataBuffer(ROWS, 1, shuffle=False).next_groups(3)) == ["p0", "p1", "p2"]


def test_state_round_trip_resumes_exactly():
    buf = DataBuffer(ROWS, 2, seed=3, epochs=3)
    buf.next_groups(7)
    aborted = buf.next_groups(2)
    aborted[0][0].response = "partial"
    buf.return_groups(aborted)
    state = json.loads(json.dumps(buf.state_dict()))  # JSON-able
    expected = [[(s.prompt, s.group_index, s.index, s.response, s.status) for s in g] for g in buf.next_groups(15)]
    resumed = DataBuffer(ROWS, 2, seed=3, epochs=3)
    resumed.load_state_dict(state)
    got = [[(s.prompt, s.group_index, s.index, s.response, s.status) for s in g] for g in resumed.next_groups(15)]
    assert got == expected
    assert got[0][0][3] == "partial" and got[0][0][4] == SampleStatus.ABORTED
    with pytest.raises(Exception, match="same data.path"):
        DataBuffer(ROWS[:5], 2).load_state_dict(state)


def test_returned_groups_are_served_first():
    buf = DataBuffer(ROWS, 2, shuffle=False, keep_partial=False)
    a, b = buf.next_groups(2)
    a[0].response, a[0].tokens = "half", [1, 2]
    buf.return_groups([a])
    buf.return_groups([b])
    nxt = buf.next_groups(3)
    assert prompts(nxt) == ["p1", "p0", "p2"]
    assert nxt[1][0].response == "" and nxt[1][0].tokens == [] and nxt[1][0].group_index == a[0].group_index


def rewarded(rewards, gid=0):
    return [Sample(prompt="p", reward=r, group_index=gid) for r in rewards]


def test_nonzero_std_and_apply_filters():
    f = NonzeroStd()
    assert f(rewarded([1.0, 0.0])) is None
    assert f(rewarded([1.0, 1.0])) == "all_correct" and f(rewarded([0.0, 0.0])) == "all_wrong"
    assert f(rewarded([1.0, None])) == "too_few_scored"
    kept, metrics = apply_filters([rewarded([1, 0]), rewarded([1, 1]), rewarded([0, 0]), rewarded([0, 0])], [f])
    assert len(kept) == 1
    assert metrics == {"dynamic_sampling/kept": 1.0, "dynamic_sampling/drop/nonzero_std/all_correct": 1.0,
                       "dynamic_sampling/drop/nonzero_std/all_wrong": 2.0,
                       "dynamic_sampling/reward_mean": 3 / 8}  # over all 8 samples, the dropped groups' too


def fake_rollout(rewards_for, delay=0.0):
    """Generate-and-reward stand-in: rewards chosen per prompt, optional delay per prompt."""
    started = []

    async def rollout(group):
        started.append(group[0].prompt)
        await asyncio.sleep(delay(group[0].prompt) if callable(delay) else delay)
        for s, r in zip(group, rewards_for(group[0].prompt)):
            s.reward, s.status = r, SampleStatus.COMPLETED
        return group
    rollout.started = started
    return rollout


async def test_dynamic_sampling_fills_the_batch_and_returns_unfinished_groups():
    # even prompts: mixed rewards (kept); odd prompts: all equal (dropped). p9 is slow.
    buf = DataBuffer(ROWS, 2, shuffle=False)
    rollout = fake_rollout(lambda p: [1.0, 0.0] if int(p[1:]) % 2 == 0 else [1.0, 1.0],
                           delay=lambda p: 5.0 if p == "p9" else 0.0)
    groups, metrics = await collect_groups(buf, rollout, batch_size=4, filters=[NonzeroStd()],
                                           over_sampling_batch_size=6)
    assert prompts(groups) == ["p0", "p2", "p4", "p6"]
    assert metrics["dynamic_sampling/drop/nonzero_std/all_correct"] >= 3
    assert metrics["dynamic_sampling/kept"] == 4 and "dynamic_sampling/incomplete" not in metrics
    # p9 was still generating when the batch filled: aborted and served first next time
    assert metrics["dynamic_sampling/aborted"] >= 1
    assert buf.next_groups(1)[0][0].prompt in {"p7", "p8", "p9"}


async def test_dynamic_sampling_reports_running_out_of_data():
    buf = DataBuffer(ROWS[:4], 2, shuffle=False, epochs=1)
    rollout = fake_rollout(lambda p: [1.0, 1.0] if p != "p0" else [1.0, 0.0])
    with pytest.raises(DataExhausted, match=r"ran out after 1 epoch\(s\) of 4 prompts: kept 1 of 3 groups .*"
                                            r"4 sampled, 3 dropped by filters"):
        await collect_groups(buf, rollout, batch_size=3, filters=[NonzeroStd()])


async def test_dynamic_sampling_limit():
    buf = DataBuffer(ROWS, 2, shuffle=False, epochs=5)
    rollout = fake_rollout(lambda p: [0.0, 0.0])
    groups, metrics = await collect_groups(buf, rollout, batch_size=2, filters=[NonzeroStd()],
                                           max_sampled_groups=7)
    assert groups == [] and metrics["dynamic_sampling/incomplete"] == 1.0
    assert metrics["dynamic_sampling/sampled"] == 7 and len(rollout.started) == 7


async def test_a_failing_rollout_gives_in_flight_groups_back():
    buf = DataBuffer(ROWS, 1, shuffle=False)

    async def rollout(group):
        if group[0].prompt == "p1":
            raise RuntimeError("engine died")
        await asyncio.sleep(5)
        return group
    with pytest.raises(RuntimeError, match="engine died"):
        await collect_groups(buf, rollout, batch_size=3)
    assert sorted(prompts(buf.next_groups(2))) == ["p0", "p2"]


def test_from_run_config():
    from posttrain.core.config import load_config

    cfg = load_config(None, ["seed=7", "data.epochs=2", "data.shuffle=false"], data={
        "estimator": "grpo", "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 4},
        "trainer": {"global_batch_size": 8}})
    buf = DataBuffer.from_config(cfg, ROWS)
    assert (buf.n, buf.seed, buf.epochs, buf.shuffle) == (4, 7, 2, False)
    assert prompts(buf.next_groups(2)) == ["p0", "p1"]


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 7), min_size=1, max_size=12), cut=st.integers(0, 11),
       seed=st.integers(0, 1000), n_rows=st.integers(1, 9))
def test_every_prompt_once_per_epoch_and_resume_anywhere(sizes, cut, seed, n_rows):
    rows = ROWS[:n_rows]
    buf = DataBuffer(rows, 1, seed=seed, epochs=2)
    served, state_at_cut = [], None
    for i, k in enumerate(sizes):
        if i == cut:
            state_at_cut = (buf.state_dict(), len(served))
        served += prompts(buf.next_groups(k))
    assert len(served) == min(sum(sizes), 2 * n_rows)
    for epoch in range(2):  # each epoch is a permutation of the rows
        chunk = served[epoch * n_rows:(epoch + 1) * n_rows]
        assert len(set(chunk)) == len(chunk)
    if state_at_cut is not None:
        state, done = state_at_cut
        resumed = DataBuffer(rows, 1, seed=seed, epochs=2)
        resumed.load_state_dict(state)
        rest = []
        for k in sizes[cut:]:
            rest += prompts(resumed.next_groups(k))
        assert served[done:] == rest
