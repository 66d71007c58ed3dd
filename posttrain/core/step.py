"""One RL step, top to bottom:

    batch (generation) -> trainer's turn on the GPUs -> log-probs (old policy, reference, critic values)
    -> corrections (importance weights against the engines' log-probs) -> advantages (estimator) -> train (loss)
    -> new weights to the engines -> metrics (and eval at its interval)

:func:`run_step` is the sequence; each part below is one function. A step whose batch holds no trainable sample
(every reward failed, every sample aborted) logs its rollout metrics and trains nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from posttrain.core import batching
from posttrain.core.estimator_inputs import estimator_metadata, estimator_metrics
from posttrain.core.evaluation import evaluate
from posttrain.core.flops import throughput_metrics
from posttrain.core.generation import Generation
from posttrain.core.losses import kl_penalty_rewards
from posttrain.core.memory_plan import MemoryPlan
from posttrain.core.metrics import PhaseTimer, ServerMetrics
from posttrain.core.rewards import RewardRunner, reward_metrics
from posttrain.core.types import AdvantageBatch

log = logging.getLogger("posttrain.loop")


@dataclass
class StepParts:
    """What a step uses, built once at start-up (``core.loop``). ``on_trainer(fn, *args)`` runs a trainer call on
    the step's trainer thread; ``empty_steps`` counts steps with nothing to train on (checkpointed)."""

    cfg: Any
    trainer: Any
    engines: Any
    generator: Any
    estimator: Any
    rewards: RewardRunner
    tokenizer: Any
    base_dir: Path
    generation: Generation
    memory: MemoryPlan
    on_trainer: Callable[..., Awaitable[Any]]
    timer: PhaseTimer
    server_metrics: ServerMetrics = field(default_factory=ServerMetrics)
    empty_steps: int = 0


@dataclass
class Learned:
    """A trained batch: the trainer's own metrics (``train/`` once logged), the step's other metrics (corrections,
    train/rollout log-prob mismatch, policy entropy)."""

    train_metrics: dict[str, float]
    metrics: dict[str, float]


@dataclass
class StepResult:
    metrics: dict[str, float]
    groups: list
    samples: list


async def run_step(parts: StepParts, step: int) -> StepResult:
    """Step ``step``: its batch, the training on it, the push of the new weights; the step's metrics."""
    t0, timer, cfg = time.perf_counter(), parts.timer, parts.cfg
    with timer("generate"):  # prompts -> samples -> rewards -> filters (dynamic sampling generates until full)
        (groups, sampling_metrics), generate_s = await parts.generation.take(step)
    parts.generation.overlap(step + 1)  # async: step N+1 generates while step N trains
    samples = batching.trainable(groups)
    if not samples:
        return StepResult(await _empty_step(parts, step, groups, sampling_metrics, t0), groups, samples)
    await parts.memory.trainer_turn(timer)
    learned = await learn(parts, samples)
    await parts.generation.wait_overlap(timer)  # the push after it, so no response mixes versions
    eval_due = bool(cfg.eval.interval) and (step + 1) % cfg.eval.interval == 0
    (restarted, push_s, push_bytes), offloaded_gib = await parts.memory.engines_turn(
        timer, lambda: parts.generation.push_if_due(step, eval_due))
    phases, step_time = timer.pop(), time.perf_counter() - t0
    perf = _throughput(parts, learned, samples, step_time, phases)  # takes the FLOPs counts out of train_metrics
    last = {**batching.rollout_metrics(samples, step), **batching.dropped_metrics(groups),
            **reward_metrics(groups), **estimator_metrics(parts.estimator), **sampling_metrics, **learned.metrics,
            **{f"train/{k}": v for k, v in learned.train_metrics.items()}, **phases, "perf/step_time": step_time,
            "perf/engine_restarts": float(len(restarted)), "perf/weight_push_s": push_s,
            "perf/weight_push_bytes": float(push_bytes),
            **parts.server_metrics(parts.trainer, parts.engines), **perf,
            **({"perf/trainer_offloaded_gib": offloaded_gib} if parts.memory.offload else {}),
            "rollout/empty_steps": float(parts.empty_steps),  # fully_async: over generation, not the wait
            "perf/rollout_tokens_per_s": sum(s.response_length for s in samples) / max(
                sampling_metrics.get("perf/generation_s", generate_s), 1e-9)}
    if eval_due:
        last.update(await evaluate(cfg, parts.generation.engine, parts.generator, parts.rewards, parts.base_dir,
                                   parts.tokenizer))
    return StepResult(last, groups, samples)


async def learn(parts: StepParts, samples: list) -> Learned:
    """batch -> log-probs -> corrections -> advantages -> optimizer steps. The old policy's log-probs come from
    the train step when they are the batch's only use of them (``batching.old_log_probs_from_train``)."""
    cfg, trainer, timer = parts.cfg, parts.trainer, parts.timer
    batch, reward, group_index, rollout_lp = batching.to_batch(samples)
    batch.temperature = cfg.rollout.temperature  # the trainer scores the distribution the engine sampled from
    fused = batching.old_log_probs_from_train(cfg, parts.estimator)
    with timer("log_probs"):  # the sampling policy as the trainer sees it, the reference, critic values
        if not fused:
            batch.old_log_probs, entropy = await parts.on_trainer(trainer.log_probs, batch, None, True)
        if cfg.trainer.uses_reference:
            batch.ref_log_probs = await parts.on_trainer(trainer.log_probs, batch, "ref")
        values = await parts.on_trainer(trainer.values, batch) if parts.estimator.needs.critic else None
    metrics = {}
    if cfg.correction is not None:
        batch.is_weights, correction_metrics = trainer.importance_weights(batch, rollout_lp)
        metrics.update({f"correction/{k}": v for k, v in correction_metrics.items()})
    _advantages(parts, batch, reward, group_index, values, samples)
    with timer("train"):
        if fused:
            train_metrics, batch.old_log_probs, entropy = await parts.on_trainer(trainer.train, batch, True)
        else:
            train_metrics = await parts.on_trainer(trainer.train, batch)
    metrics.update({**batching.mismatch_metrics(batch.old_log_probs, rollout_lp, batch.response_mask),
                    **batching.policy_metrics(batch, entropy)})
    return Learned(train_metrics, metrics)


def _advantages(parts: StepParts, batch: Any, reward: Any, group_index: Any, values: Any, samples: list) -> None:
    """``batch.advantages`` and ``batch.returns`` over the whole batch ([B, T] each), from the sample rewards
    ([B]), per-token KL penalties ``-coef * KL(old || ref)`` when ``trainer.kl_in_reward_coef`` > 0, and critic
    values ([B, T]) for estimators that need them."""
    tc = parts.cfg.trainer
    token_rewards = (kl_penalty_rewards(batch.old_log_probs, batch.ref_log_probs, batch.response_mask,
                                        tc.kl_in_reward_coef, tc.kl_kind) if tc.kl_in_reward_coef > 0 else None)
    batch.advantages, batch.returns = parts.estimator.advantages(AdvantageBatch(
        rewards=reward, group_index=group_index, response_mask=batch.response_mask, values=values,
        token_rewards=token_rewards, log_probs=batch.old_log_probs, metadata=estimator_metadata(samples)))
    batch.old_values = values


def _throughput(parts: StepParts, learned: Learned, samples: list, step_time: float,
                phases: dict[str, float]) -> dict[str, float]:
    """``core.flops.throughput_metrics`` over the trainer's devices and, unless colocated, the engines'; pops the
    FLOPs counts from ``learned.train_metrics``."""
    res = parts.cfg.resources
    devices = res.trainer_world_size + (0 if res.colocate else res.rollout_gpus)
    return throughput_metrics(learned.train_metrics, batching.train_tokens(samples), step_time,
                              phases["perf/time_train"], devices)


async def _empty_step(parts: StepParts, step: int, groups: list, sampling_metrics: dict[str, float],
                      t0: float) -> dict[str, float]:
    """No trainable sample: the run goes on. ``fully_async`` still pushes (the same weights under the next
    version), so staleness keeps counting steps."""
    parts.empty_steps += 1
    log.warning("step %d: no trainable sample (%d groups); skipped, the run goes on", step, len(groups))
    last = {**reward_metrics(groups), **batching.dropped_metrics(groups), **sampling_metrics,
            **parts.timer.pop(), "rollout/samples": 0.0, "rollout/empty_steps": float(parts.empty_steps),
            "perf/step_time": time.perf_counter() - t0}
    if parts.generation.feeder is not None:
        await parts.generation.push(step + 1)
    return last
