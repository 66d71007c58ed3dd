"""The data buffer: prompt groups out, aborted groups back in, dynamic sampling over both.

- :class:`DataBuffer` hands out groups of ``n_samples_per_prompt`` fresh samples sharing one unique
  ``group_index``; it walks the prompts epoch by epoch (shuffled with ``seed + epoch``) and serves
  groups given back with :meth:`DataBuffer.return_groups` first. Its :meth:`~DataBuffer.state_dict`
  (epoch, offset, counters, returned groups) restores the exact same stream after a resume.
- :func:`apply_filters` runs the dynamic-sampling filters (``posttrain_register_filters``) over
  rewarded groups and counts drop reasons.
- :func:`collect_groups` is dynamic sampling with over-sampling: it keeps generating (through a
  ``rollout(group)`` coroutine the loop supplies) until ``batch_size`` groups pass the filters, a
  limit is hit, or the data runs out; groups still in flight when the batch is full are aborted and
  go back to the buffer.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from posttrain.core.errors import UsageError
from posttrain.core.types import Sample, SampleStatus

log = logging.getLogger("posttrain.buffer")


class DataExhausted(UsageError):
    """The prompt data ran out before the batch was full (all epochs served)."""


class DataBuffer:
    """Prompt groups from a dataset (``PromptDataset`` or any sequence of rows with ``prompt``,
    ``label``, ``metadata``).

    :param n_samples_per_prompt: ``G``, samples per group.
    :param seed: shuffling uses ``random.Random(seed + epoch)``.
    :param epochs: passes over the data; after the last one :meth:`next_groups` returns fewer groups
        (possibly none) and :attr:`exhausted` is True.
    :param keep_partial: groups given back keep their partial responses (for generators that resume
        a partial rollout); with False they come back as fresh samples.
    """

    def __init__(self, dataset: Sequence[Any], n_samples_per_prompt: int, seed: int = 0, shuffle: bool = True,
                 epochs: int = 1, keep_partial: bool = True):
        if n_samples_per_prompt < 1:
            raise UsageError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        if len(dataset) == 0:
            raise UsageError("the data buffer got an empty dataset")
        self.dataset, self.n = dataset, n_samples_per_prompt
        self.seed, self.shuffle, self.epochs, self.keep_partial = seed, shuffle, epochs, keep_partial
        self.epoch, self.offset = 0, 0
        self.next_group_index, self.next_sample_index = 0, 0
        self.returned: list[list[Sample]] = []
        self._order_epoch, self._order = -1, []

    @classmethod
    def from_config(cls, config: Any, dataset: Sequence[Any]) -> DataBuffer:
        """From a ``RunConfig``: ``rollout.n_samples_per_prompt``, ``seed``, ``data.shuffle``, ``data.epochs``."""
        return cls(dataset, config.rollout.n_samples_per_prompt, seed=config.seed, shuffle=config.data.shuffle,
                   epochs=config.data.epochs)

    # ---- the stream ----
    def order(self, epoch: int) -> list[int]:
        """Row indices for ``epoch`` (a permutation seeded with ``seed + epoch`` when shuffling)."""
        if self._order_epoch != epoch:
            self._order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    @property
    def exhausted(self) -> bool:
        """No returned groups left and every epoch served."""
        return not self.returned and self.epoch >= self.epochs

    def remaining(self) -> int:
        """Groups still to be served (returned ones included)."""
        if self.epoch >= self.epochs:
            return len(self.returned)
        return len(self.returned) + (self.epochs - self.epoch) * len(self.dataset) - self.offset

    def next_groups(self, k: int) -> list[list[Sample]]:
        """Up to ``k`` groups: returned groups first, then new prompts. Fewer only when exhausted."""
        out = self.returned[:k]
        self.returned = self.returned[k:]
        while len(out) < k and self.epoch < self.epochs:
            order = self.order(self.epoch)
            out.append(self._make_group(self.dataset[order[self.offset]]))
            self.offset += 1
            if self.offset >= len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def _make_group(self, row: Any) -> list[Sample]:
        gid = self.next_group_index
        self.next_group_index += 1
        group = []
        for _ in range(self.n):
            group.append(Sample(prompt=_copy(row.prompt), label=_copy(row.label),
                                metadata=_copy_metadata(row.metadata), group_index=gid,
                                index=self.next_sample_index, images=getattr(row, "images", None)))
            self.next_sample_index += 1
        return group

    def return_groups(self, groups: list[list[Sample]]) -> None:
        """Give back groups that were not finished (aborted): they are served first, in this order,
        before earlier returned groups. Samples are marked ``ABORTED`` (or reset to fresh samples
        when ``keep_partial`` is False); ``group_index`` and ``index`` are kept."""
        back = []
        for group in groups:
            if self.keep_partial:
                for s in group:
                    if s.status not in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
                        s.status = SampleStatus.ABORTED
                back.append(group)
            else:
                back.append([fresh_copy(s) for s in group])
        self.returned = back + self.returned

    # ---- checkpointing ----
    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able): resume restores the exact stream, returned groups included."""
        return {"epoch": self.epoch, "offset": self.offset, "next_group_index": self.next_group_index,
                "next_sample_index": self.next_sample_index, "seed": self.seed, "dataset_size": len(self.dataset),
                "returned": [[_sample_to_dict(s) for s in g] for g in self.returned]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("dataset_size", len(self.dataset)) != len(self.dataset):
            raise UsageError(f"the checkpoint's data buffer saw {state['dataset_size']} prompts, the data now has "
                             f"{len(self.dataset)}: resume with the same data.path")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.next_group_index, self.next_sample_index = int(state["next_group_index"]), int(state["next_sample_index"])
        self.returned = [[_sample_from_dict(d) for d in g] for g in state.get("returned", [])]


def _copy(value: Any) -> Any:
    """A sample's own copy of a row's value (strings and numbers are immutable: shared)."""
    return value if isinstance(value, (str, int, float, type(None))) else copy.deepcopy(value)


def _copy_metadata(metadata: Any) -> Any:
    """A sample's own metadata, value by value through :func:`_copy` (one deepcopy of the whole dict costs
    ~10 us a sample, a thousand samples a step; immutable values need none)."""
    return {k: _copy(v) for k, v in metadata.items()} if isinstance(metadata, dict) else _copy(metadata)


def fresh_copy(sample: Sample) -> Sample:
    """The sample as the buffer first handed it out (prompt, label, metadata, ids), nothing generated."""
    return Sample(prompt=copy.deepcopy(sample.prompt), label=copy.deepcopy(sample.label),
                  metadata=copy.deepcopy(sample.metadata), group_index=sample.group_index, index=sample.index,
                  images=sample.images)


def _sample_to_dict(s: Sample) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    d["status"] = s.status.value
    return d


def _sample_from_dict(d: dict[str, Any]) -> Sample:
    return Sample(**{**d, "status": SampleStatus(d["status"])})


# ---- dynamic sampling ----

def apply_filters(groups: list[list[Sample]], filters: Sequence[Any],
                  counts: Counter | None = None) -> tuple[list[list[Sample]], dict[str, float]]:
    """Keep the groups every filter keeps. A filter is called with a rewarded group and returns
    ``None`` (keep) or a reason string (drop); the first filter that drops a group names the reason.

    Returns ``(kept, metrics)`` with ``dynamic_sampling/drop/<filter>/<reason>`` counts,
    ``dynamic_sampling/kept`` and, with filters, ``dynamic_sampling/reward_mean``: the mean reward over every
    scored sample of the groups filtered, dropped ones included (``rollout/reward_mean`` covers the kept
    groups only: with ``nonzero_std`` it leaves out the all-correct and all-wrong ones, so it is not the
    policy's reward). ``counts`` (a Counter) accumulates across calls when given (:func:`count_metrics`).
    """
    counts = Counter() if counts is None else counts
    kept = []
    for group in groups:
        if filters:
            scored = [s.reward for s in group if s.reward is not None]
            counts["_reward_sum"] += float(sum(scored))
            counts["_scored"] += len(scored)
        reason = None
        for f in filters:
            reason = f(group)
            if reason is not None:
                counts[f"dynamic_sampling/drop/{getattr(f, 'name', type(f).__name__)}/{reason}"] += 1
                break
        if reason is None:
            kept.append(group)
            counts["dynamic_sampling/kept"] += 1
    return kept, count_metrics(counts)


def count_metrics(counts: Counter) -> dict[str, float]:
    """The ``dynamic_sampling/*`` metrics of counts :func:`apply_filters` accumulated (its running sums,
    keys starting with ``_``, become ``dynamic_sampling/reward_mean``)."""
    out = {k: float(v) for k, v in counts.items() if not k.startswith("_")}
    if counts.get("_scored"):
        out["dynamic_sampling/reward_mean"] = counts["_reward_sum"] / counts["_scored"]
    return out


async def collect_groups(buffer: DataBuffer, rollout: Callable[[list[Sample]], Awaitable[list[Sample]]],
                         batch_size: int, filters: Sequence[Any] = (), over_sampling_batch_size: int | None = None,
                         max_sampled_groups: int | None = None) -> tuple[list[list[Sample]], dict[str, float]]:
    """Generate until ``batch_size`` groups pass ``filters`` (dynamic sampling with over-sampling).

    Whenever the groups in flight cannot fill the batch, ``over_sampling_batch_size`` more groups are
    started (default ``batch_size``). ``rollout(group)`` generates and rewards one group and returns it.
    When the batch is full, groups still in flight are cancelled and returned to the buffer (served
    first next time); surplus groups that finished at the same moment are dropped and counted.

    :returns: ``(groups, metrics)``; fewer than ``batch_size`` groups only when ``max_sampled_groups``
        (default ``8 x batch_size``) was hit, reported as ``dynamic_sampling/incomplete = 1``.
    :raises DataExhausted: the data ran out before the batch was full.
    """
    over = over_sampling_batch_size or batch_size
    limit = max_sampled_groups or 8 * batch_size
    counts: Counter = Counter()
    kept: list[list[Sample]] = []
    in_flight: dict[asyncio.Task, list[Sample]] = {}
    finished: asyncio.Queue = asyncio.Queue()  # tasks as they end (asyncio.wait over all would cost O(n) each)
    sampled = 0
    try:
        while len(kept) < batch_size:
            need = batch_size - len(kept)
            if len(in_flight) < need and sampled < limit:
                new = buffer.next_groups(min(max(over, need - len(in_flight)), limit - sampled))
                sampled += len(new)
                for group in new:
                    task = asyncio.ensure_future(rollout(group))
                    task.add_done_callback(finished.put_nowait)
                    in_flight[task] = group
            if not in_flight:
                break
            done = [await finished.get()]  # the first to end, and every other that has ended by now
            while not finished.empty():
                done.append(finished.get_nowait())
            for task in sorted(done, key=lambda t: in_flight[t][0].group_index):  # deterministic order
                in_flight.pop(task)
                passed, _ = apply_filters([task.result()], filters, counts)
                if passed and len(kept) < batch_size:
                    kept += passed
                elif passed:  # finished together with the group that filled the batch
                    counts["dynamic_sampling/kept"] -= 1
                    counts["dynamic_sampling/surplus"] += 1
    finally:
        if in_flight:  # the batch is full (or something raised): abort the rest, give them back
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            buffer.return_groups(list(in_flight.values()))
            counts["dynamic_sampling/aborted"] += len(in_flight)
    counts["dynamic_sampling/sampled"] += sampled
    kept.sort(key=lambda g: g[0].group_index if g else -1)  # serving order, not completion order
    metrics = count_metrics(counts)
    if len(kept) < batch_size:
        dropped = sum(v for k, v in counts.items() if k.startswith("dynamic_sampling/drop/"))
        story = (f"kept {len(kept)} of {batch_size} groups this step ({sampled} sampled, "
                 f"{dropped} dropped by filters)")
        if buffer.exhausted:
            raise DataExhausted(f"the prompt data ran out after {buffer.epochs} epoch(s) of "
                                f"{len(buffer.dataset)} prompts: {story}; add data, raise data.epochs, or "
                                f"lower rollout.num_rollouts")
        log.warning("dynamic sampling hit data.max_sampled_groups=%d: %s", limit, story)
        metrics["dynamic_sampling/incomplete"] = 1.0
    return kept, metrics
