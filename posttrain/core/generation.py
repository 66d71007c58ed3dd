"""Where a step's samples come from, and the weight pushes that keep the engines on the trainer's version.

A group's rollout: the generator samples it through the engines, the rewards score it, an estimator that asks
for a baseline gets one, a teacher adds its log-probs. ``rollout.mode``:

- ``sync``: the step generates its batch (dynamic-sampling filters keep generating until it is full);
- ``async``: step N+1's generation starts when step N's batch is in (:meth:`Generation.overlap`), so it runs
  while step N trains; the push waits for it (:meth:`Generation.wait_overlap`), so no response mixes versions;
- ``fully_async``: a background producer (``core.async_rollout``) keeps generating into a bounded queue; a step
  takes the oldest finished batch, and pushes pause the engines.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from posttrain.core.async_rollout import FullyAsyncRollout
from posttrain.core.buffer import DataBuffer, collect_groups
from posttrain.core.estimator_inputs import add_baseline
from posttrain.core.metrics import PhaseTimer
from posttrain.core.rewards import RewardRunner
from posttrain.core.rollout.supervise import push_weights, watching
from posttrain.core.rollout.teacher import add_teacher_log_probs


class Generation:
    """The run's generation and weight pushes. ``engine``: the generators' client; ``engines``: the role
    (supervised while a batch generates, restarted by a push when one died); ``on_trainer`` runs a trainer call on
    the step's trainer thread."""

    def __init__(self, cfg: Any, buffer: DataBuffer, engines: Any, engine: Any, generator: Any, estimator: Any,
                 rewards: RewardRunner, sampling: Any, filters: list, teacher: Any, trainer: Any, latest_dir: str,
                 on_trainer: Callable[..., Awaitable[Any]]):
        self.cfg, self.buffer, self.engines, self.engine, self.filters = cfg, buffer, engines, engine, filters
        self.generator, self.estimator, self.rewards, self.sampling = generator, estimator, rewards, sampling
        self.teacher, self.trainer, self.latest_dir, self.on_trainer = teacher, trainer, latest_dir, on_trainer
        self.feeder: FullyAsyncRollout | None = None
        self.pending: asyncio.Future | None = None  # async mode: the next step's generation, already running

    def start_feeder(self, start: int, state: dict[str, Any]) -> FullyAsyncRollout:
        """``fully_async``: the producer and its queue, from step ``start``; a checkpoint's queued groups
        (``state``) come back first. The caller closes it and starts it with the first step."""
        self.feeder = FullyAsyncRollout.from_config(self.cfg, self.buffer, self.rollout_group, self.engine,
                                                    self.filters, start)
        self.feeder.load_state_dict(state)
        return self.feeder

    async def rollout_group(self, group: list) -> list:
        """One prompt group: samples, rewards, an estimator's baseline, a teacher's log-probs."""
        group = await self.generator(group, self.engine, self.sampling)
        await self.rewards.score_groups([group])
        await add_baseline(group, self.estimator, self.generator, self.engine, self.sampling, self.rewards)
        await add_teacher_log_probs(group, self.teacher)
        return group

    def generate(self, step: int) -> asyncio.Future:
        """Step ``step``'s groups and sampling metrics, with the generation's wall time, as a future."""
        rollout, data = self.cfg.rollout, self.cfg.data
        batch = self.feeder.next_batch(step) if self.feeder else collect_groups(
            self.buffer, self.rollout_group, rollout.rollout_batch_size, self.filters, data.over_sampling_batch_size,
            data.max_sampled_groups)
        return asyncio.ensure_future(watching(self.engines, self.engine, batch))

    def overlap(self, step: int) -> None:
        """``async`` mode: start step ``step``'s generation now (the last step starts none)."""
        due = self.cfg.rollout.mode == "async" and step < self.cfg.rollout.num_rollouts
        self.pending = self.generate(step) if due else None

    async def take(self, step: int) -> tuple[tuple[list, dict[str, float]], float]:
        """Step ``step``'s batch: the overlapped generation's, or one generated now."""
        return await (self.pending or self.generate(step))

    async def wait_overlap(self, timer: PhaseTimer) -> None:
        """Before a push: the overlapped generation finishes on the weights it started with."""
        if self.pending is not None:
            with timer("generate_wait"):
                await asyncio.wait([self.pending])

    async def push(self, version: int) -> tuple[list[str], float, int]:
        """New weights to every engine (``fully_async`` pauses them for it): the engines restarted, the push's
        seconds and bytes."""
        def sync():
            return push_weights(self.trainer, self.engines, version, self.latest_dir)
        return await (self.feeder.push(sync, version) if self.feeder else self.on_trainer(sync))

    async def push_if_due(self, step: int, eval_due: bool) -> tuple[list[str], float, int]:
        """After step ``step``'s training: the push, unless ``fully_async``'s ``update_weights_interval`` skips it."""
        last = step + 1 == self.cfg.rollout.num_rollouts
        if self.feeder is None or self.feeder.push_due(step, last, eval_due):
            return await self.push(step + 1)
        return [], 0.0, 0

    def cancel(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
