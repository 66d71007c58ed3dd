"""The RL loop. One step, top to bottom:

    prompts (data buffer) -> generate (generator -> engines) -> rewards -> dynamic-sampling filters
    -> log-probs (old policy, reference, critic values) -> advantages (estimator) -> train (loss)
    -> push weights to the engines -> log, checkpoint, eval; at the end the policy in RUN_DIR/hf-final

Every component comes from the plugin registries by the name the run config gives; nothing here names
one. ``rollout.mode: async`` starts generating step N+1 before training step N (one step off-policy,
staleness 1: the engines keep step N-1's weights until both are done, then get step N's).
``rollout.mode: fully_async`` never stops generating (``core.async_rollout``: a background producer, a
bounded queue of finished groups, the staleness bound; pushes pause the engines, ``core.rollout.preempt``).
Engines whose backend can wait for their checkpoint (``waits_for_checkpoint``) start while the trainer builds and
writes it. ``resources.colocate`` shares the GPUs: the engines release their memory after generating and take it
back (weights, the update, then the KV cache) before the next generation; with ``resources.offload_trainer`` the
trainer's state waits in host memory meanwhile, from before the engines load (the checkpoint appears after the
offload, so they size themselves in its room): it is on the device only while their KV cache is released (its
turn, the first push, a checkpoint).

    rl-cli run examples/quickstart.yaml
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from typing import Any

from posttrain.core import batching, gpu_memory
from posttrain.core.async_rollout import FullyAsyncRollout
from posttrain.core.buffer import DataBuffer, collect_groups
from posttrain.core.data import load_prompts
from posttrain.core.estimator_inputs import add_baseline, estimator_metadata, estimator_metrics
from posttrain.core.evaluation import evaluate
from posttrain.core.executors import EXECUTORS
from posttrain.core.flops import throughput_metrics
from posttrain.core.gcutil import settle_heap
from posttrain.core.hf_init import write_model_files
from posttrain.core.losses import kl_penalty_rewards
from posttrain.core.metrics import MetricsWriter, PhaseTimer, ServerMetrics
from posttrain.core.rewards import RewardRunner, reward_metrics
from posttrain.core.rollout.client import EngineClient
from posttrain.core.rollout.coalesce import CoalescingEngine
from posttrain.core.rollout.preempt import PausableEngine
from posttrain.core.rollout.supervise import push_weights, watching
from posttrain.core.rollout.teacher import add_teacher_log_probs, launch_teacher, open_teacher
from posttrain.core.types import AdvantageBatch

log = logging.getLogger("posttrain.loop")


async def train(cfg: Any, plugins: Any, run: Any, resume: bool = False, on_step: Any = None,
                on_phase: Any = None) -> dict[str, float]:
    """Run ``cfg`` to ``rollout.num_rollouts`` steps in ``run`` (a RunDirectory); the last metrics. Every
    role rebuilds the same plugin set (``plugins.load_args``) in its own process. ``on_phase(name)`` marks
    each start-up phase, ``on_step(step, metrics, samples)`` each step's end."""
    phase = on_phase or (lambda name, detail="": None)
    executor = EXECUTORS[cfg.resources.executor](cfg, **plugins.load_args)
    # A step's trainer calls run on one thread of their own, not on asyncio's pool: PyTorch gives each thread that
    # runs a matmul its own cuBLAS handle and each handle a workspace (32 MiB on Hopper); with the pool's threads
    # taking turns, the trainer's memory grew by one workspace a step (bench/RESULTS.md)
    trainer_thread = ThreadPoolExecutor(1, thread_name_prefix="posttrain-trainer")

    def on_trainer(fn, *args):
        return asyncio.get_running_loop().run_in_executor(trainer_thread, fn, *args)

    async with AsyncExitStack() as stack:
        stack.callback(executor.close)
        stack.callback(trainer_thread.shutdown)  # after trainer.close (callbacks run last-in first-out)
        # -- roles: the trainer builds the model; engines start from RUN_DIR/hf-init (core.hf_init): the model's
        # config and tokenizer, their weights coming with the first push, or (checkpoint.hf_init_weights, or a
        # backend that must read weights) the trainer's initial weights too. Engines that need not size their memory
        # beside the trainer start on it at once; those that can wait for it start first and import meanwhile, and
        # load it once it appears, in the room the trainer leaves them (colocated: beside it, or after its offload)
        colocate, offload = cfg.resources.colocate, cfg.resources.offload_trainer
        backend = cfg.rollout.engine.create(plugins)
        weightless = backend.starts_without_weights and not cfg.checkpoint.hf_init_weights
        init_dir, spec = run.fresh_dir("hf-init"), cfg.model.create(plugins)
        early = weightless and not colocate  # hf-init before the trainer builds
        first = executor.engines_before_trainer and (early or backend.waits_for_checkpoint)
        pending = first and backend.waits_for_checkpoint  # launched before hf-init exists (imports meanwhile)
        if early and not pending:
            write_model_files(spec, init_dir)
        if first:
            engines = executor.engines(init_dir, run.logs, model_pending=pending, weights_from_push=weightless,
                                       wait=False)
            stack.callback(engines.close)
        if early and pending:
            write_model_files(spec, init_dir)
        teacher_role = launch_teacher(cfg, plugins, executor, run.logs)  # or None; loads its own checkpoint meanwhile
        if teacher_role is not None:
            stack.callback(teacher_role.close)
        phase("model", "the engines start beside it" if first else "")
        trainer = executor.trainer(run.logs)  # one rank in this process, or a group of ranks
        written = run.fresh_dir("hf-init.staged") if first and offload else init_dir  # (offloads are colocated)
        if weightless and not early:
            phase("model_files")
            write_model_files(spec, written)
        elif not weightless:
            phase("init_checkpoint")
            trainer.save_hf(written, replace=True)  # appears whole
        ckpt = run.latest_checkpoint() if resume else None
        if ckpt is not None:  # another model's checkpoint is refused before the first push
            run.check_resume(ckpt, cfg.to_dict(), written)
        if offload:  # the engines load in the room the trainer's state leaves, as they will generate in it
            phase("offload")
            trainer.offload()
        if written != init_dir:  # only now may the engines that wait for it load it
            os.replace(written, init_dir)
        if not first:
            phase("engines")
            engines = executor.engines(init_dir, run.logs, weights_from_push=weightless)
            stack.callback(engines.close)
        stack.callback(trainer.close)  # runs first: leaves the weight-update group while engines still answer

        # -- data, rewards, algorithm (while engines that started first load the checkpoint)
        phase("data")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(init_dir)
        dataset = load_prompts(cfg.data, tokenizer=tokenizer, base_dir=run.base_dir)
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

        # -- the engines answer; the trainer joins them for weight updates; generators reach them by one client
        if first:
            phase("engines")
        engines.wait_ready()
        (url, engine_urls), key = engines.urls(), engines.api_key()
        phase("connect")
        trainer.connect_engines(engine_urls, api_key=key)
        engine = await stack.enter_async_context(EngineClient(url, max_concurrency=cfg.rollout.server_concurrency,
                                                              api_key=key))
        teacher = await stack.enter_async_context(open_teacher(cfg, teacher_role, executor, init_dir, run.logs))
        if cfg.rollout.coalesce_rows:  # one /generate for the groups that ask at the same instant
            engine = CoalescingEngine(engine, cfg.rollout.coalesce_rows, cfg.rollout.seeds_batch_rows)
        fully_async = cfg.rollout.mode == "fully_async"
        if fully_async:  # weight pushes pause the engines; interrupted requests continue (or restart)
            engine = PausableEngine(engine, lambda: engines.urls()[1], cfg.rollout.partial, key,
                                    cfg.rollout.weight_sync_timeout_s)

        # -- resume: trainer state, data position, RNG; metrics of later steps are dropped
        start, empty_steps, state = 0, 0, {}
        if offload:  # the trainer's state comes back (for the load and the first push) beside the engines'
            engines.release_memory(["kv_cache"])  # weights, in the room of their KV cache
        if resume:
            done = -1  # killed before its first checkpoint: start over
            if ckpt is not None:
                phase("resume")
                trainer.load(str(ckpt / "trainer"))
                state = run.load_checkpoint(ckpt)
                buffer.load_state_dict(state["buffer"])
                done, empty_steps = state["step"], state.get("empty_steps", 0)
            start = done + 1
            metrics_out.truncate_after(done)
            run.truncate_after(done)
        version = start
        phase("weights")
        trainer.push_weights(version, str(run.path / "hf-latest"))
        if offload:
            trainer.offload()
            engines.resume_memory(["kv_cache"])

        async def rollout_group(group):
            group = await generator(group, engine, sampling)
            await rewards.score_groups([group])
            await add_baseline(group, estimator, generator, engine, sampling, rewards)  # estimators that ask
            await add_teacher_log_probs(group, teacher)
            return group

        feeder = None  # fully_async: the producer and its queue; the checkpoint's groups come back first
        if fully_async:
            feeder = FullyAsyncRollout.from_config(cfg, buffer, rollout_group, engine, filters, start)
            feeder.load_state_dict(state.get("fully_async", {}))
            stack.push_async_callback(feeder.close)

        def generate(step: int):
            batch = feeder.next_batch(step) if feeder else collect_groups(
                buffer, rollout_group, cfg.rollout.rollout_batch_size, filters,
                cfg.data.over_sampling_batch_size, cfg.data.max_sampled_groups)
            return asyncio.ensure_future(watching(engines, engine, batch))

        async def push(version: int):  # new weights to every engine (fully_async pauses them for it)
            def sync():
                return push_weights(trainer, engines, version, str(run.path / "hf-latest"))
            return await (feeder.push(sync, version) if feeder else on_trainer(sync))

        def end_step(step: int, last: dict[str, float], groups: list, samples: list) -> None:
            metrics_out.log(step, last)
            run.log_rollouts(step, groups, batching.sample_log(samples))
            plugins.pm.hook.posttrain_on_step_end(step=step, metrics=last)
            if on_step is not None and ((step + 1) % cfg.logging.interval == 0 or step + 1 == cfg.rollout.num_rollouts):
                on_step(step, last, samples)
            if cfg.checkpoint.interval and ((step + 1) % cfg.checkpoint.interval == 0
                                            or step + 1 == cfg.rollout.num_rollouts):
                queued = {"fully_async": feeder.state_dict()} if feeder else {}  # same instant as the buffer's
                metrics_out.sync()
                if offload:  # the save brings the trainer's state back beside the engines' weights, not their KV cache
                    engines.release_memory(["kv_cache"])
                run.save_checkpoint(step, trainer.save, {"buffer": buffer.state_dict(), "empty_steps": empty_steps,
                                                         "config": cfg.to_dict(), **queued}, cfg.checkpoint.keep)
                if offload:
                    engines.resume_memory(["kv_cache"])

        last: dict[str, float] = {}
        gpus = gpu_memory.watch()  # the devices' used memory through each phase (None without NVML: CPU)
        if gpus is not None:
            stack.callback(gpus.close)
        timer, server_metrics = PhaseTimer(memory=gpus), ServerMetrics()
        pending = None  # async mode: the next step's generation, already running
        settle_heap()  # start-up's objects leave the collector; a step's short-lived ones die unscanned
        phase("train")
        if feeder is not None:
            feeder.start()
        for step in range(start, cfg.rollout.num_rollouts):
            t0 = time.perf_counter()
            # 1-4. prompts -> samples -> rewards -> filters (dynamic sampling keeps generating until full)
            with timer("generate"):
                (groups, sampling_metrics), generate_s = await (pending or generate(step))
            overlap = cfg.rollout.mode == "async" and step + 1 < cfg.rollout.num_rollouts
            pending = generate(step + 1) if overlap else None  # step N+1 generates while step N trains
            samples = batching.trainable(groups)
            if not samples:  # every reward failed or every sample was aborted: nothing to train on
                empty_steps += 1
                log.warning("step %d: no trainable sample (%d groups); skipped, the run goes on", step, len(groups))
                last = {**reward_metrics(groups), **batching.dropped_metrics(groups), **sampling_metrics,
                        **timer.pop(), "rollout/samples": 0.0, "rollout/empty_steps": float(empty_steps),
                        "perf/step_time": time.perf_counter() - t0}
                if feeder is not None:  # the same weights under the next version: staleness counts steps
                    await push(step + 1)
                end_step(step, last, groups, samples)
                continue
            if colocate:  # the trainer's turn on the shared GPUs
                with timer("release"):
                    await asyncio.to_thread(engines.release_memory)
                if offload:  # the trainer's state back from host memory
                    with timer("onload"):
                        await on_trainer(trainer.onload)
            batch, reward, group_index, rollout_lp = batching.to_batch(samples)

            # 5. log-probs: the sampling policy as the trainer sees it, the reference, critic values
            # (the old policy's come from the train step when it is the batch's only one: old_log_probs_from_train)
            fused = batching.old_log_probs_from_train(cfg, estimator)
            with timer("log_probs"):
                if not fused:
                    batch.old_log_probs, entropy = await on_trainer(trainer.log_probs, batch, None, True)
                if cfg.trainer.uses_reference:
                    batch.ref_log_probs = await on_trainer(trainer.log_probs, batch, "ref")
                values = await on_trainer(trainer.values, batch) if estimator.needs_critic else None
            step_metrics = {}
            if cfg.correction is not None:
                batch.is_weights, correction_metrics = trainer.importance_weights(batch, rollout_lp)
                step_metrics.update({f"correction/{k}": v for k, v in correction_metrics.items()})

            # 6. advantages over the whole batch, then optimizer steps
            token_rewards = (kl_penalty_rewards(batch.old_log_probs, batch.ref_log_probs, batch.response_mask,
                                                cfg.trainer.kl_in_reward_coef, cfg.trainer.kl_kind)
                             if cfg.trainer.kl_in_reward_coef > 0 else None)
            batch.advantages, batch.returns = estimator.advantages(AdvantageBatch(
                rewards=reward, group_index=group_index, response_mask=batch.response_mask, values=values,
                token_rewards=token_rewards, log_probs=batch.old_log_probs, metadata=estimator_metadata(samples)))
            batch.old_values = values
            with timer("train"):
                if fused:
                    train_metrics, batch.old_log_probs, entropy = await on_trainer(trainer.train, batch, True)
                else:
                    train_metrics = await on_trainer(trainer.train, batch)
            step_metrics.update({**batching.mismatch_metrics(batch.old_log_probs, rollout_lp, batch.response_mask),
                                 **batching.policy_metrics(batch, entropy)})

            # 7. new weights to the engines (after the overlapped generation, so no response mixes versions)
            if pending is not None:
                with timer("generate_wait"):
                    await asyncio.wait([pending])
            eval_due = bool(cfg.eval.interval) and (step + 1) % cfg.eval.interval == 0
            with timer("sync"):
                version, restarted, push_s, push_bytes = step + 1, [], 0.0, 0
                if colocate:  # room for the engine's weights, the update, then its KV cache
                    await on_trainer(trainer.release_memory)
                    await asyncio.to_thread(engines.resume_memory, ["weights"])
                if feeder is None or feeder.push_due(step, step + 1 == cfg.rollout.num_rollouts, eval_due):
                    restarted, push_s, push_bytes = await push(version)
            if offload:  # the trainer's state to host memory while the engines generate
                with timer("offload"):
                    offloaded_gib = await on_trainer(trainer.offload)
            if colocate:
                with timer("sync"):  # the engines' KV cache last, in the room the trainer left
                    await asyncio.to_thread(engines.resume_memory, ["kv_cache"])

            # log, checkpoint, eval
            phases, step_time = timer.pop(), time.perf_counter() - t0
            tokens = sum(s.response_length for s in samples)
            devices = cfg.resources.trainer_world_size + (0 if colocate else cfg.resources.rollout_gpus)
            perf = throughput_metrics(train_metrics, batching.train_tokens(samples), step_time,
                                      phases["perf/time_train"], devices)
            last = {**batching.rollout_metrics(samples, step), **batching.dropped_metrics(groups),
                    **reward_metrics(groups), **estimator_metrics(estimator),
                    **sampling_metrics, **step_metrics, **{f"train/{k}": v for k, v in train_metrics.items()},
                    **phases, "perf/step_time": step_time, "perf/engine_restarts": float(len(restarted)),
                    "perf/weight_push_s": push_s,
                    "perf/weight_push_bytes": float(push_bytes), **server_metrics(trainer, engines), **perf,
                    **({"perf/trainer_offloaded_gib": offloaded_gib} if offload else {}),
                    "rollout/empty_steps": float(empty_steps),  # fully_async: over generation, not the wait
                    "perf/rollout_tokens_per_s": tokens / max(sampling_metrics.get("perf/generation_s", generate_s),
                                                              1e-9)}
            if eval_due:
                last.update(await evaluate(cfg, engine, generator, rewards, run.base_dir, tokenizer))
            end_step(step, last, groups, samples)
        if pending is not None:
            pending.cancel()
        if offload:  # the engines are done: their memory for the trainer's state, back for the export
            await asyncio.to_thread(engines.release_memory)
        trainer.save_hf(str(run.path / "hf-final"))  # the final policy: transformers loads it, engines serve it
        return last
