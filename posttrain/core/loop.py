"""The RL loop: start-up, then one step after another, then the final policy in RUN_DIR/hf-final.

    start the roles (core.startup) -> data, rewards, algorithm -> connect the engines -> resume, first push
    -> every step (core.step): generate -> log-probs -> advantages -> train -> push -> log, checkpoint, eval
    -> export

Every component comes from the plugin registries by the name the run config gives; nothing here names
one. ``rollout.mode: async`` starts generating step N+1 before training step N (one step off-policy,
staleness 1: the engines keep step N-1's weights until both are done, then get step N's).
``rollout.mode: fully_async`` never stops generating (``core.async_rollout``: a background producer, a
bounded queue of finished groups, the staleness bound; pushes pause the engines, ``core.rollout.preempt``);
``core.generation`` holds the three. Engines whose backend can wait for their checkpoint start while the trainer
builds and writes it (``core.startup``). ``resources.colocate`` shares the GPUs, and ``resources.offload_trainer``
keeps the trainer's state in host memory while the engines generate (``core.memory_plan``).

    rl-cli run examples/quickstart.yaml
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Callable

from posttrain.core import batching, gpu_memory, interrupts
from posttrain.core.buffer import DataBuffer
from posttrain.core.data import load_prompts
from posttrain.core.executors import EXECUTORS
from posttrain.core.gcutil import settle_heap
from posttrain.core.generation import Generation
from posttrain.core.memory_plan import MemoryPlan
from posttrain.core.metrics import MetricsWriter, PhaseTimer
from posttrain.core.rewards import RewardRunner
from posttrain.core.rollout.client import EngineClient
from posttrain.core.rollout.coalesce import CoalescingEngine
from posttrain.core.rollout.preempt import PausableEngine
from posttrain.core.rollout.teacher import open_teacher
from posttrain.core.startup import Roles, start_roles
from posttrain.core.step import StepParts, StepResult, run_step
from posttrain.core.watchdog import Watchdog, tick, waiting_on, watch_roles

__all__ = ["train"]


async def train(cfg: Any, plugins: Any, run: Any, resume: bool = False, on_step: Any = None,
                on_phase: Any = None) -> dict[str, float]:
    """Run ``cfg`` to ``rollout.num_rollouts`` steps in ``run`` (a RunDirectory); the last metrics. Every
    role rebuilds the same plugin set (``plugins.load_args``) in its own process. ``on_phase(name)`` marks
    each start-up phase, ``on_step(step, metrics, samples)`` each step's end."""
    executor = EXECUTORS[cfg.resources.executor](cfg, **plugins.load_args)
    # A step's trainer calls run on one thread of their own, not on asyncio's pool: PyTorch gives each thread that
    # runs a matmul its own cuBLAS handle and each handle a workspace (32 MiB on Hopper); with the pool's threads
    # taking turns, the trainer's memory would grow by one workspace a step
    trainer_thread = ThreadPoolExecutor(1, thread_name_prefix="posttrain-trainer")

    def on_trainer(fn, *args):
        return asyncio.get_running_loop().run_in_executor(trainer_thread, fn, *args)

    async with AsyncExitStack() as stack:
        watchdog = _watchdog(cfg, run, stack)
        phase = _ticking(on_phase)
        stack.callback(executor.close)
        stack.callback(trainer_thread.shutdown)  # after trainer.close (callbacks run last-in first-out)
        roles = start_roles(cfg, plugins, executor, run, stack, resume, phase)
        watch_roles(watchdog, roles.trainer, roles.engines)
        setup = _load_setup(cfg, plugins, run, roles, stack, phase)  # while the engines load
        generation = await _connect(cfg, executor, run, roles, setup, stack, phase, on_trainer)
        memory = MemoryPlan(cfg.resources.colocate, cfg.resources.offload_trainer, roles.trainer, roles.engines,
                            on_trainer)
        with memory.around_first_push():
            start, state = _resume(cfg, run, roles, setup, resume, phase)
            phase("weights")
            with waiting_on("weight_push", f"first weight push (version {start})"):
                roles.trainer.push_weights(start, str(run.path / "hf-latest"))
        if cfg.rollout.mode == "fully_async":  # the checkpoint's queued groups come back first
            stack.push_async_callback(generation.start_feeder(start, state.get("fully_async", {})).close)
        parts = StepParts(cfg, roles.trainer, roles.engines, setup.generator, setup.estimator, setup.rewards,
                          setup.tokenizer, run.base_dir, generation, memory, on_trainer, _phase_timer(stack),
                          empty_steps=state.get("empty_steps", 0))
        settle_heap()  # start-up's objects leave the collector; a step's short-lived ones die unscanned
        phase("train")
        watchdog.training()
        if generation.feeder is not None:
            generation.feeder.start()
        last: dict[str, float] = {}
        with interrupts.graceful(cfg.checkpoint.stop_timeout_s if cfg.checkpoint.on_stop else None):
            for step in range(start, cfg.rollout.num_rollouts):
                result = await run_step(parts, step)
                tick()
                last = result.metrics
                saved = _end_step(parts, setup, run, plugins, on_step, step, result)
                if interrupts.pending() is not None:  # Ctrl-C/SIGTERM during the step: stop at its boundary
                    if not saved:
                        _save_checkpoint(parts, setup, run, step)
                    raise interrupts.pending()
        generation.cancel()
        await memory.before_export()
        roles.trainer.save_hf(str(run.path / "hf-final"))  # the final policy: transformers loads it, engines serve it
        return last


def _watchdog(cfg: Any, run: Any, stack: AsyncExitStack) -> Watchdog:
    """The run's watchdog (``watchdog:``), started now and stopped last, after every role closed."""
    watchdog = Watchdog(cfg.watchdog, run.path / "stall-report.txt",
                        resume_hint=f"rl-cli run --resume {run.path} continues from its last checkpoint")
    stack.callback(watchdog.stop)
    return watchdog.start()


def _ticking(on_phase: Any) -> Callable[..., None]:
    """``on_phase`` (or nothing), each start-up phase also progress for the watchdog."""
    def phase(name: str, detail: str = "") -> None:
        tick()
        if on_phase is not None:
            on_phase(name, detail)
    return phase


@dataclass
class _Setup:
    """Data, rewards and algorithm: built while the engines load."""

    tokenizer: Any
    buffer: DataBuffer
    rewards: RewardRunner
    generator: Any
    estimator: Any
    filters: list
    sampling: Any
    metrics_out: MetricsWriter


def _load_setup(cfg: Any, plugins: Any, run: Any, roles: Roles, stack: AsyncExitStack,
                      phase: Callable[..., None]) -> _Setup:
    phase("data")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(roles.init_dir)
    vision = None
    if cfg.data.images_key:  # max_prompt_len counts image tokens
        from posttrain.core.vision import ImageInputs

        vision = ImageInputs.from_dir(roles.init_dir)
    dataset = load_prompts(cfg.data, tokenizer=tokenizer, base_dir=run.base_dir, vision=vision)
    buffer = DataBuffer.from_config(cfg, dataset)
    rewards = RewardRunner.from_config(cfg, plugins)
    stack.push_async_callback(rewards.aclose)
    generator = cfg.generator.create(plugins)
    estimator = cfg.estimator.create(plugins)
    filters = [f.create(plugins) for f in cfg.filters]
    sampling = cfg.rollout.sampling_params(seed=cfg.seed, return_routed_experts=cfg.trainer.backend.create(
        plugins).needs_routed_experts)
    metrics_out = MetricsWriter(run.path, cfg.logging.tensorboard, cfg.logging.wandb,
                                cfg.logging.wandb_project, cfg.to_dict())  # secrets redacted there
    stack.callback(metrics_out.close)
    return _Setup(tokenizer, buffer, rewards, generator, estimator, filters, sampling, metrics_out)


async def _connect(cfg: Any, executor: Any, run: Any, roles: Roles, setup: _Setup, stack: AsyncExitStack,
                   phase: Callable[..., None], on_trainer: Callable) -> Generation:
    """The engines answer; the trainer joins them for weight updates; generators reach them by one client
    (coalescing the groups that ask at the same instant; pausable for ``fully_async``'s pushes)."""
    engines = roles.engines
    if roles.order.engines_first:
        phase("engines")
    engines.wait_ready()
    (url, engine_urls), key = engines.urls(), engines.api_key()
    phase("connect")
    roles.trainer.connect_engines(engine_urls, api_key=key)
    engine = await stack.enter_async_context(EngineClient(url, max_concurrency=cfg.rollout.server_concurrency,
                                                          api_key=key))
    teacher = await stack.enter_async_context(open_teacher(cfg, roles.teacher_role, executor, roles.init_dir,
                                                           run.logs))
    if cfg.rollout.coalesce_rows:  # one /generate for the groups that ask at the same instant
        engine = CoalescingEngine(engine, cfg.rollout.coalesce_rows, cfg.rollout.seeds_batch_rows)
    if cfg.rollout.mode == "fully_async":  # weight pushes pause the engines; interrupted requests continue
        engine = PausableEngine(engine, lambda: engines.urls()[1], cfg.rollout.partial, key,
                                cfg.rollout.weight_sync_timeout_s)
    return Generation(cfg, setup.buffer, engines, engine, setup.generator, setup.estimator, setup.rewards,
                      setup.sampling, setup.filters, teacher, roles.trainer, str(run.path / "hf-latest"), on_trainer)


def _resume(cfg: Any, run: Any, roles: Roles, setup: _Setup, resume: bool,
            phase: Callable[..., None]) -> tuple[int, dict[str, Any]]:
    """The first step and the checkpoint's state (``{}`` when starting): the trainer's state, the data
    position; metrics of later steps are dropped. A run killed before its first checkpoint starts over."""
    if not resume:
        return 0, {}
    done, state = 0, {}
    if roles.checkpoint is not None:
        phase("resume")
        roles.trainer.load(str(roles.checkpoint / "trainer"))
        state = run.load_checkpoint(roles.checkpoint)
        setup.buffer.load_state_dict(state["buffer"])
        done = state["steps"]
    setup.metrics_out.truncate_after(done)
    run.truncate_after(done)
    return done, state  # the 0-based index of the next step is the number of steps done


def _phase_timer(stack: AsyncExitStack) -> PhaseTimer:
    """Each phase's seconds, and the devices' used memory through it (no NVML, as on a CPU: seconds only)."""
    gpus = gpu_memory.watch()
    if gpus is not None:
        stack.callback(gpus.close)
    return PhaseTimer(memory=gpus)


def _end_step(parts: StepParts, setup: _Setup, run: Any, plugins: Any, on_step: Any, step: int,
              result: StepResult) -> bool:
    """The metrics, rollouts and hooks of the step of 0-based index ``step`` (written as step ``step + 1``, as
    the console counts); the live view at ``logging.interval``; a checkpoint at ``checkpoint.interval`` (after
    the metrics: a kill between them cannot lose the row on resume). Whether it saved one."""
    cfg, last = parts.cfg, result.metrics
    setup.metrics_out.log(step + 1, last)
    run.log_rollouts(step + 1, result.groups, batching.sample_log(result.samples))
    plugins.pm.hook.posttrain_on_step_end(step=step + 1, metrics=last)
    final = step + 1 == cfg.rollout.num_rollouts
    if on_step is not None and ((step + 1) % cfg.logging.interval == 0 or final):
        on_step(step, last, result.samples)
    if cfg.checkpoint.interval and ((step + 1) % cfg.checkpoint.interval == 0 or final):
        _save_checkpoint(parts, setup, run, step)
        return True
    return False


def _save_checkpoint(parts: StepParts, setup: _Setup, run: Any, step: int) -> None:
    """The checkpoint after the step of 0-based index ``step`` (``step_{step + 1}``): the trainer's state, the
    data position, the fully-async queue."""
    cfg = parts.cfg
    feeder = parts.generation.feeder
    queued = {"fully_async": feeder.state_dict()} if feeder else {}  # same instant as the buffer's
    setup.metrics_out.sync()
    with parts.memory.around_checkpoint():
        state = {"buffer": setup.buffer.state_dict(), "empty_steps": parts.empty_steps, "config": cfg.to_dict(),
                 **queued}
        run.save_checkpoint(step + 1, parts.trainer.save, state, cfg.checkpoint.keep)
