"""The fully-async producer and queue (``core.async_rollout``) with the real data buffer and filters; the
rollout is a coroutine that records the versions the engines held while it ran (no engine here: the
pause-and-continue over a real engine is in tests/unit/core/rollout/test_preempt.py)."""

import asyncio
import json
import random
import time
from collections import Counter
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest

from posttrain.core.async_rollout import FullyAsyncRollout, split_stale, staleness
from posttrain.core.buffer import DataBuffer, DataExhausted, collect_groups
from posttrain.core.types import Sample, SampleStatus

PROMPTS = [SimpleNamespace(prompt=f"p{i}", label=str(i), metadata={}) for i in range(12)]


class Engines:
    """What the feeder needs of a PausableEngine: ``paused()`` (here: no request may run inside it)."""

    def __init__(self):
        self.pausing, self.pushes, self.continued = False, 0, 0

    @asynccontextmanager
    async def paused(self):
        self.pausing = True
        try:
            yield
        finally:
            self.pausing, self.pushes = False, self.pushes + 1


def rollout_with(feeder_box, rng, partial=True):
    """A rollout that takes a random time and records the engines' version per token: the first half of
    the tokens under the version at its start, the rest under the version at its end (a partial rollout
    continued across a push)."""

    async def rollout(group):
        v0 = feeder_box["f"].version
        await asyncio.sleep(rng.uniform(0, 0.004))
        v1 = feeder_box["f"].version if partial else v0
        for s in group:
            s.tokens, s.response_length, s.reward = [1, 2, 3, 4], 2, 1.0
            s.weight_version, s.weight_versions = v1, [v0, v1]
            s.status = SampleStatus.COMPLETED
        return group

    return rollout


async def drive(feeder, steps, trained, train_s=0.002, rng=None, check=None):
    for step in range(feeder.steps_taken, steps):
        groups, metrics = await feeder.next_batch(step)
        if check:
            check(step, groups, metrics)
        trained.append([g[0].prompt for g in groups])
        await asyncio.sleep(train_s * (rng.random() if rng else 1))
        if feeder.push_due(step, step + 1 == steps, False):
            await feeder.push(lambda: None, step + 1)


@pytest.mark.parametrize("k,interval", [(0, 1), (1, 1), (2, 1), (2, 3)])
async def test_staleness_never_exceeds_k_per_sample(k, interval):
    rng = random.Random(k * 10 + interval)
    buf = DataBuffer(PROMPTS, n_samples_per_prompt=2, seed=0, epochs=10)
    box = {}
    feeder = box["f"] = FullyAsyncRollout(buf, rollout_with(box, rng), Engines(), batch_size=3, max_staleness=k,
                                          update_interval=interval)
    seen = []

    def check(step, groups, metrics):
        assert len(groups) == 3
        ages = [staleness(s, step) for g in groups for s in g]
        assert all(0 <= a <= k for a in ages), (step, ages)  # from each sample's recorded token versions
        assert metrics["rollout/staleness_max"] == max(ages)
        assert metrics["rollout/dropped_stale"] == 0  # the producer never starts what would be stale
        seen.extend(ages)

    feeder.start()
    await drive(feeder, 30, [], rng=rng, check=check)
    await feeder.close()
    if k:  # the bound was reached, not merely respected by a producer that never ran ahead
        assert max(seen) == k


async def test_max_staleness_0_serves_the_groups_of_sync_mode():
    box = {}

    async def rollout(group):
        await asyncio.sleep(random.random() * 0.002)
        for s in group:
            s.tokens, s.response_length, s.reward, s.status = [1, 2], 1, 1.0, SampleStatus.COMPLETED
            s.weight_version, s.weight_versions = box["f"].version, [box["f"].version]
        return group

    sync_buf = DataBuffer(PROMPTS, n_samples_per_prompt=2, seed=3, epochs=3)
    sync = [[(s.index, s.group_index) for g in (await collect_groups(sync_buf, rollout_with({"f": SimpleNamespace(
        version=0)}, random.Random(0)), 4))[0] for s in g] for _ in range(8)]
    feeder = box["f"] = FullyAsyncRollout(DataBuffer(PROMPTS, n_samples_per_prompt=2, seed=3, epochs=3), rollout,
                                          Engines(), batch_size=4, max_staleness=0)
    feeder.start()
    fully = []
    for step in range(8):
        groups, metrics = await feeder.next_batch(step)
        assert metrics["rollout/staleness_max"] == 0
        fully.append([(s.index, s.group_index) for g in groups for s in g])
        assert not feeder.in_flight  # nothing runs ahead of the trainer with k = 0
        await feeder.push(lambda: None, step + 1)
    assert fully == sync


async def test_generation_time_spans_the_batchs_groups_not_the_wait_for_them():
    """``perf/generation_s`` (what ``perf/rollout_tokens_per_s`` divides by): from the first start to the last
    finish of the batch's groups, also when they finished while the trainer trained (nothing to wait for)."""
    gen_s = 0.02

    async def rollout(group):
        version = feeder.version
        await asyncio.sleep(gen_s)
        for s in group:
            s.tokens, s.response_length, s.reward, s.status = [1, 2], 1, 1.0, SampleStatus.COMPLETED
            s.weight_version, s.weight_versions = version, [version]
        return group

    feeder = FullyAsyncRollout(DataBuffer(PROMPTS, 2, seed=0, epochs=2), rollout, Engines(), batch_size=2,
                               max_staleness=1)
    began = time.perf_counter()
    feeder.start()
    for step in range(4):
        ready = len(feeder.queue) >= 2  # finished during the last "train": next_batch returns at once
        groups, metrics = await feeder.next_batch(step)
        assert len(groups) == 2
        assert gen_s <= metrics["perf/generation_s"] <= time.perf_counter() - began
        assert ready or step == 0
        await asyncio.sleep(3 * gen_s)  # training, while the producer generates the next batch
        await feeder.push(lambda: None, step + 1)
    await feeder.close()
    assert set(feeder._span) == {id(g) for g, _ in feeder.queue}  # nothing kept of trained groups


async def test_filters_free_their_slot_and_are_counted():
    rng = random.Random(1)
    box = {}
    feeder = box["f"] = FullyAsyncRollout(DataBuffer(PROMPTS, 2, seed=0, epochs=20), rollout_with(box, rng), Engines(),
                                          batch_size=2, filters=[OddGroups()], max_staleness=1, buffer_size=2)
    feeder.start()
    counts = Counter()
    for step in range(6):
        groups, metrics = await feeder.next_batch(step)
        assert [g[0].group_index % 2 for g in groups] == [0, 0]
        counts.update(metrics)
        await feeder.push(lambda: None, step + 1)
    await feeder.close()
    # a buffer of 2 groups still fills every batch of 2: each dropped group made room for the next
    assert counts["dynamic_sampling/kept"] >= 12 and counts["dynamic_sampling/drop/odd_groups/odd"] >= 11


class OddGroups:
    name = "odd_groups"

    def __call__(self, group):
        return "odd" if group[0].group_index % 2 else None


@pytest.mark.parametrize("stale", ["drop", "recompute"])
async def test_over_sampled_groups_past_the_bound_are_dropped_or_recomputed(stale):
    """Over-sampling starts more groups than a step takes: those left over past k versions are stale."""
    box = {}
    feeder = box["f"] = FullyAsyncRollout(DataBuffer(PROMPTS, 2, seed=0, epochs=1), rollout_with(box, random.Random(2),
                                          partial=False), Engines(), batch_size=2, max_staleness=0, stale=stale,
                                          over_sampling_batch_size=4, buffer_size=4)
    feeder.start()
    trained, dropped = [], 0
    try:
        for step in range(6):
            groups, metrics = await feeder.next_batch(step)
            assert all(staleness(s, step) == 0 for g in groups for s in g)
            dropped += metrics["rollout/dropped_stale"]
            trained += [g[0].prompt for g in groups]
            await feeder.push(lambda: None, step + 1)
    except DataExhausted:
        pass
    assert dropped > 0
    if stale == "recompute":  # every prompt regenerated and trained once
        assert sorted(trained) == sorted(p.prompt for p in PROMPTS)
    else:
        left = [g[0].prompt for g, _ in feeder.queue]  # finished, too few for a batch when the data ran out
        assert not feeder.in_flight and len(set(trained + left)) == len(trained + left)
        assert len(trained) + len(left) + feeder.dropped_total / 2 == len(PROMPTS), (trained, left, dropped)


def test_split_stale_goes_by_the_oldest_token():
    def s(versions):
        return Sample(prompt="x", weight_version=versions[-1], weight_versions=versions)

    young, old = [s([3, 4]), s([4, 4])], [s([4, 4]), s([1, 4])]
    assert split_stale([young, old], 4, 2) == ([young], [old])
    assert staleness(Sample(prompt="x", weight_version=2), 5) == 3  # no per-token versions: the sample's


async def test_checkpoint_holds_the_queue_and_the_prompts_in_flight():
    """Snapshots at random moments, a 'crash' after each (everything not in the snapshot is lost), a new
    feeder from the snapshot: every prompt is trained exactly once per epoch, no step repeated or skipped."""
    rng = random.Random(7)
    epochs, steps = 3, 18  # 12 prompts x 3 epochs = 36 groups = 18 steps of 2
    trained, step_log = [], []
    state, done = None, -1
    for crash in range(10):
        buf = DataBuffer(PROMPTS, 1, seed=0, epochs=epochs)
        box = {}
        feeder = box["f"] = FullyAsyncRollout(buf, rollout_with(box, rng), Engines(), batch_size=2, max_staleness=2,
                                              start=done + 1)
        if state is not None:
            state = json.loads(json.dumps(state))  # what a checkpoint keeps
            buf.load_state_dict(state["buffer"])
            feeder.load_state_dict(state["fully_async"])
        del trained[(done + 1) * 2:], step_log[done + 1:]  # the steps after the checkpoint are redone
        feeder.start()
        crash_at = rng.randint(done + 2, min(done + 4, steps))
        for step in range(done + 1, crash_at):
            groups, _ = await feeder.next_batch(step)
            trained.extend((g[0].prompt, g[0].group_index) for g in groups)
            step_log.append(step)
            await asyncio.sleep(rng.uniform(0, 0.003))
            await feeder.push(lambda: None, step + 1)
            if rng.random() < 0.7:  # a checkpoint, taken in one instant with the buffer's
                state, done = {"buffer": buf.state_dict(), "fully_async": feeder.state_dict()}, step
        await asyncio.sleep(rng.uniform(0, 0.003))  # killed with groups in flight and queued
        await feeder.close()
        if step_log and step_log[-1] == steps - 1 and done == steps - 1:
            break
    if done < steps - 1:  # the last resume runs to the end
        buf = DataBuffer(PROMPTS, 1, seed=0, epochs=epochs)
        box = {}
        feeder = box["f"] = FullyAsyncRollout(buf, rollout_with(box, rng), Engines(), 2, max_staleness=2,
                                              start=done + 1)
        buf.load_state_dict(state["buffer"])
        feeder.load_state_dict(state["fully_async"])
        del trained[(done + 1) * 2:], step_log[done + 1:]
        feeder.start()
        for step in range(done + 1, steps):
            groups, _ = await feeder.next_batch(step)
            trained.extend((g[0].prompt, g[0].group_index) for g in groups)
            step_log.append(step)
            await feeder.push(lambda: None, step + 1)
        await feeder.close()
    assert step_log == list(range(steps))
    assert Counter(p for p, _ in trained) == {p.prompt: epochs for p in PROMPTS}
    assert len({gi for _, gi in trained}) == len(trained)  # no group trained twice
