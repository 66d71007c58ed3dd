"""``rollout.mode: fully_async``: generation that never waits for training.

:class:`FullyAsyncRollout` runs a background producer in the loop's event loop: it takes prompt groups
from the data buffer, rolls each out (generate, reward, extras: the loop's ``rollout_group``), runs the
dynamic-sampling filters, and appends the groups that pass to a bounded queue of finished groups. The
loop's :meth:`~FullyAsyncRollout.next_batch` takes ``rollout_batch_size`` groups as soon as the queue
holds them; the trainer trains while the engines keep generating; every
``rollout.update_weights_interval`` steps the new weights are pushed (:meth:`~FullyAsyncRollout.push`),
pausing the engines (:class:`~posttrain.core.rollout.preempt.PausableEngine`: the requests in flight
continue from their partial tokens with ``rollout.partial``, else restart).

**Versions and staleness.** The trainer's version at step ``s`` is ``s`` (updates done); a push after step
``s`` gives the engines version ``s + 1``. Each sample records the version of every response token
(``Sample.weight_versions``); its staleness at step ``s`` is ``s - min(weight_versions)``.

- The producer starts a group only while ``steps_taken * B + queued + in_flight < (v + k + 1) * B + extra``
  (``B`` = ``rollout_batch_size``, ``v`` the engines' version, ``k`` = ``rollout.max_staleness``,
  ``extra`` = over-sampling beyond ``B``), and ``queued + in_flight < rollout.async_buffer_size``: a group
  started under version ``v`` is trained by step ``v + k``. With ``k = 0`` and ``interval = 1`` this is
  exactly sync mode (same groups, same samples, same losses for a seeded run).
- :meth:`next_batch` at step ``s`` waits for groups in flight that started under version ``s - k`` or
  earlier (after this step they would be stale) and takes the oldest groups first.
- It still checks every group: one whose oldest sample is more than ``k`` versions behind
  is dropped (``rollout/dropped_stale`` counts its samples) or, with ``rollout.stale: recompute``, goes back
  to the front of the data buffer as fresh samples. A filtered group frees its slot at once.
- Metrics of each batch: ``rollout/staleness_mean`` (over samples), ``rollout/staleness_max``,
  ``rollout/dropped_stale``, ``rollout/async_queue_groups`` (finished groups waiting after the batch was
  taken), ``rollout/async_in_flight``, ``rollout/partial_continued`` (requests sent again after a pause,
  summed over the run), ``perf/generation_s`` (from the first start to the last finish of the batch's
  groups: the generation time that ``perf/rollout_tokens_per_s`` divides by, not the wait for the batch)
  and the ``dynamic_sampling/*`` counts since the last batch.

**Checkpoints.** :meth:`state_dict` (taken in the same instant as the data buffer's) holds the finished
groups not yet trained and the prompts in flight. :meth:`load_state_dict` queues the finished groups again
(they are trained first) and puts the in-flight prompts at the front of the data buffer as fresh samples
(their partial tokens are discarded): every prompt of the data order is trained exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from posttrain.core.buffer import (DataBuffer, DataExhausted, _sample_from_dict, _sample_to_dict, apply_filters,
                                   count_metrics, fresh_copy)
from posttrain.core.types import Sample

log = logging.getLogger("posttrain.async")

Group = list[Sample]


def staleness(sample: Sample, trainer_version: int) -> int:
    """Versions between the trainer's and the oldest token of ``sample``."""
    return trainer_version - sample.oldest_version


def split_stale(groups: Sequence[Group], trainer_version: int, max_staleness: int) -> tuple[list[Group], list[Group]]:
    """``(fresh, stale)``: a group is stale when any sample is more than ``max_staleness`` versions behind
    ``trainer_version`` (its advantages are relative to the whole group, so it goes whole)."""
    fresh, stale = [], []
    for g in groups:
        (stale if any(staleness(s, trainer_version) > max_staleness for s in g) else fresh).append(g)
    return fresh, stale


def staleness_metrics(groups: Sequence[Group], trainer_version: int) -> dict[str, float]:
    ages = [staleness(s, trainer_version) for g in groups for s in g]
    if not ages:
        return {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
    return {"rollout/staleness_mean": sum(ages) / len(ages), "rollout/staleness_max": float(max(ages))}


def _jsonable(s: Sample) -> dict[str, Any]:
    d = _sample_to_dict(s)
    if d.get("rollout_routed_experts") is not None:  # a numpy array (MoE routing replay)
        d["rollout_routed_experts"] = d["rollout_routed_experts"].tolist()
    return d


def _from_json(d: dict[str, Any]) -> Sample:
    s = _sample_from_dict(d)
    if s.rollout_routed_experts is not None:
        import numpy as np

        s.rollout_routed_experts = np.asarray(s.rollout_routed_experts, dtype=np.int32)
    return s


class FullyAsyncRollout:
    """The producer, its queue of finished groups, and the staleness bound (see the module docstring).

    :param rollout: ``rollout(group) -> group``, generated, rewarded (the loop's ``rollout_group``).
    :param engine: the run's :class:`~posttrain.core.rollout.preempt.PausableEngine`.
    :param start: the first step of this run (after a resume: the steps its checkpoint holds); the engines
        then hold version ``start``.
    """

    def __init__(self, buffer: DataBuffer, rollout: Callable[[Group], Awaitable[Group]], engine: Any,
                 batch_size: int, filters: Sequence[Any] = (), *, max_staleness: int = 1,
                 buffer_size: int | None = None, update_interval: int = 1, stale: str = "drop", over_sampling_batch_size: int | None = None,
                 max_sampled_groups: int | None = None, start: int = 0):
        self.buffer, self.rollout, self.engine, self.filters = buffer, rollout, engine, list(filters)
        self.batch_size, self.k, self.interval, self.stale = batch_size, max_staleness, update_interval, stale
        self.buffer_size = buffer_size or (max_staleness + 1) * batch_size
        self.extra = max(0, (over_sampling_batch_size or batch_size) - batch_size)
        self.limit = max_sampled_groups or 8 * batch_size
        self.version = start  # the engines' weights
        self.steps_taken = start
        self.queue: list[tuple[Group, int]] = []  # (finished group, the engines' version when it started)
        self.in_flight: dict[asyncio.Task, tuple[Group, int]] = {}
        self._span: dict[int, tuple[float, float]] = {}  # id(finished group) -> (start, end), perf_counter s
        self._started: dict[asyncio.Task, float] = {}
        self.counts: Counter = Counter()
        self.sampled = 0  # groups started since the last batch
        self.dropped_total = 0  # stale samples dropped (or recomputed) in this run
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._producer: asyncio.Task | None = None

    @classmethod
    def from_config(cls, cfg: Any, buffer: DataBuffer, rollout: Callable, engine: Any, filters: Sequence[Any],
                    start: int) -> FullyAsyncRollout:
        r = cfg.rollout
        return cls(buffer, rollout, engine, r.rollout_batch_size, filters, max_staleness=r.max_staleness,
                   buffer_size=r.async_buffer_size, update_interval=r.update_weights_interval, stale=r.stale,
                   over_sampling_batch_size=cfg.data.over_sampling_batch_size,
                   max_sampled_groups=cfg.data.max_sampled_groups, start=start)

    # ---- the producer ----
    def _can_start(self) -> bool:
        busy = len(self.queue) + len(self.in_flight)
        ahead = self.steps_taken * self.batch_size + busy  # groups in line, counted from the run's start
        return (not self.buffer.exhausted and busy < self.buffer_size and self.sampled < self.limit
                and ahead < (self.version + self.k + 1) * self.batch_size + self.extra)

    def _fill(self) -> None:
        """Start groups while the bounds allow (called whenever a slot may have opened)."""
        while self._error is None and self._can_start():
            [group] = self.buffer.next_groups(1)
            self.sampled += 1
            task = asyncio.ensure_future(self.rollout(group))
            self.in_flight[task] = (group, self.version)
            self._started[task] = time.perf_counter()
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        group, version = self.in_flight.pop(task, (None, 0))
        began = self._started.pop(task, None)
        if group is None or task.cancelled():
            return
        if task.exception() is not None:
            self._error = self._error or task.exception()
        else:
            passed, _ = apply_filters([task.result()], self.filters, self.counts)
            self.queue += [(g, version) for g in passed]
            self._span.update({id(g): (began, time.perf_counter()) for g in passed})
            self._fill()  # a filtered group frees its slot
        self._changed.set()

    def start(self) -> None:
        self._fill()

    async def close(self) -> None:
        tasks = list(self.in_flight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.in_flight.clear()

    # ---- the trainer's side ----
    async def next_batch(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """``rollout_batch_size`` finished groups for ``step`` (oldest first, then in serving order), stale
        ones dropped or recomputed; fewer only when ``data.max_sampled_groups`` stopped the producer.

        :raises DataExhausted: the data ran out before the batch was full."""
        dropped = 0
        while True:
            if self._error is not None:
                raise self._error
            fresh, stale = split_stale([g for g, _ in self.queue], step, self.k)
            if stale:
                stale_ids = {id(g) for g in stale}
                self.queue = [(g, v) for g, v in self.queue if id(g) not in stale_ids]
                for i in stale_ids:
                    self._span.pop(i, None)
                dropped += sum(len(g) for g in stale)
                self.dropped_total += sum(len(g) for g in stale)
                if self.stale == "recompute":
                    self.buffer.returned = [[fresh_copy(s) for s in g] for g in stale] + self.buffer.returned
                self._fill()
            due = any(v <= step - self.k for _, v in self.in_flight.values())  # stale after this step
            if len(self.queue) >= self.batch_size and not due:
                break
            if not self.in_flight and not self._can_start():
                if self.buffer.exhausted:
                    raise DataExhausted(f"the prompt data ran out after {self.buffer.epochs} epoch(s) of "
                                        f"{len(self.buffer.dataset)} prompts: {len(self.queue)} of {self.batch_size} "
                                        f"groups for step {step}; add data, raise data.epochs, or lower "
                                        f"rollout.num_rollouts")
                if self.sampled >= self.limit:
                    log.warning("dynamic sampling hit data.max_sampled_groups=%d: %d of %d groups for step %d",
                                self.limit, len(self.queue), self.batch_size, step)
                    self.counts["dynamic_sampling/incomplete"] = 1
                    break
                raise RuntimeError(f"fully_async: step {step} waits for {self.batch_size} groups, {len(self.queue)} "
                                   f"finished, none in flight and none may start (version {self.version})")
            self._changed.clear()
            await self._changed.wait()
        self.queue.sort(key=lambda item: (item[1], item[0][0].group_index if item[0] else -1))
        taken, self.queue = self.queue[: self.batch_size], self.queue[self.batch_size:]
        groups = sorted((g for g, _ in taken), key=lambda g: g[0].group_index if g else -1)
        self.counts["dynamic_sampling/sampled"] += self.sampled
        metrics = count_metrics(self.counts)
        spans = [self._span.pop(id(g)) for g in groups if id(g) in self._span]  # resumed groups have none
        if spans:
            metrics["perf/generation_s"] = max(e for _, e in spans) - min(b for b, _ in spans)
        metrics.update(staleness_metrics(groups, step))
        metrics.update({"rollout/dropped_stale": float(dropped), "rollout/async_queue_groups": float(len(self.queue)),
                        "rollout/async_in_flight": float(len(self.in_flight)),
                        "rollout/partial_continued": float(getattr(self.engine, "continued", 0))})
        self.counts, self.sampled, self.steps_taken = Counter(), 0, step + 1
        self._fill()
        return groups, metrics

    def push_due(self, step: int, last: bool, eval_due: bool) -> bool:
        """Whether the weights go to the engines after ``step``: every ``update_weights_interval`` steps, after
        the last step, and before an eval (eval runs on the current weights)."""
        return (step + 1) % self.interval == 0 or last or eval_due

    async def push(self, push: Callable[[], Any], version: int) -> Any:
        """``push()`` (blocking: it runs in a thread) with the engines paused; then they hold ``version``."""
        async with self.engine.paused():
            out = await asyncio.to_thread(push)
        self.version = version
        self._fill()
        return out

    # ---- checkpoints ----
    def state_dict(self) -> dict[str, Any]:
        """The finished groups not trained yet (with their start versions) and the prompts in flight (JSON-able)."""
        return {"queue": [{"version": v, "samples": [_jsonable(s) for s in g]} for g, v in self.queue],
                "in_flight": [[_jsonable(fresh_copy(s)) for s in g] for g, _ in self.in_flight.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the data buffer's: the saved finished groups are queued, the in-flight prompts served first."""
        self.queue = [([_from_json(d) for d in item["samples"]], int(item["version"]))
                      for item in state.get("queue", [])]
        flying = sorted(([_from_json(d) for d in g] for g in state.get("in_flight", [])),
                        key=lambda g: g[0].group_index)
        self.buffer.returned = flying + self.buffer.returned
        log.info("resume: %d finished group(s) to train first, %d prompt group(s) in flight issued again",
                 len(self.queue), len(flying))
