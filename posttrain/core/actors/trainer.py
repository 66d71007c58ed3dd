"""The trainer role: the policy (and critic, for estimators that need one) built by the selected trainer
backend, its loss, and the trainer side of weight sync. Lives in the driver (local executor) or in a Ray
actor (ray executor) when the trainer is one rank; in each rank of a
:class:`~posttrain.core.actors.trainer_group.TrainerGroup` otherwise, where every rank runs every call
(the backend's collectives need them all) and global rank 0 alone talks to the engines."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posttrain.core.interfaces import needs_of


class TrainerRole:
    """Built from the resolved run config (``RunConfig.to_dict()``); all arguments are plain data.

    Batches are :class:`~posttrain.core.train_batch.TrainBatch` (``[B, T]`` tensors aligned with
    ``tokens``); everything returned is CPU tensors or ``dict[str, float]``.
    """

    def __init__(self, config: dict[str, Any], load_args: dict[str, list[str]] | None = None):
        import dataclasses

        import torch

        from posttrain.core.config import load_config
        from posttrain.core.plugins import load_plugins

        torch.set_num_threads(max(1, torch.get_num_threads()))
        plugins = load_plugins(**(load_args or {}))
        self.cfg = cfg = load_config(None, data=config, plugins=plugins)
        self.spec = cfg.model.create(plugins)
        self.loss = cfg.loss.create(plugins)
        self.correction = cfg.correction.create(plugins) if cfg.correction else None
        estimator = plugins.estimators[cfg.estimator.name] if cfg.estimator is not None else None
        if cfg.trainer.deterministic is None:  # seeded sampling asks for a run that repeats: GPU kernels too
            cfg.trainer = dataclasses.replace(cfg.trainer, deterministic=cfg.rollout.seed_sampling)
        self.backend = cfg.trainer.backend.create(plugins)
        self.engine_backend = cfg.rollout.engine.create(plugins)
        self.plan_line = self._plan_micro_batches(needs_of(estimator).critic)
        self.policy = self.backend.build(self.spec, cfg, role="actor", seed=cfg.seed)
        self.critic = (self.backend.build(self.spec, cfg, role="critic", seed=cfg.seed)
                       if needs_of(estimator).critic else None)
        self.sender = None
        self.full_push_due = True  # the next push sends every weight (a model with adapters sends them only after)
        self.api_key: str | None = None
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.replica = getattr(self.policy, "dp_rank", 0)  # data-parallel replica: replicas hold the same weights
        self.offloaded = False  # the models' state in host memory (offload), until a call needs it (onload)

    def _plan_micro_batches(self, critic: bool) -> str | None:
        """``trainer.max_tokens_per_micro_batch: auto`` becomes the memory plan's number before the backend builds
        (``core.micro_batch_plan``); the plan's line, else None."""
        import dataclasses

        if self.cfg.trainer.max_tokens_per_micro_batch != "auto":
            return None
        from posttrain.core.micro_batch_plan import plan_for

        plan = plan_for(self.cfg, self.spec.hf_config(), self.backend.logits_chunk_tokens(), critic)
        self.cfg.trainer = dataclasses.replace(self.cfg.trainer, max_tokens_per_micro_batch=plan.tokens)
        return plan.line()

    def micro_batch_plan(self) -> str | None:
        """The start-up line of ``trainer.max_tokens_per_micro_batch: auto`` (None when the key is not auto)."""
        return self.plan_line

    # ---------------------------------------------------------------- forward passes
    def _pass(self, what: str):
        """Around a pass: out of GPU memory, the run ends with one line naming the keys that shrink it."""
        from posttrain.core.out_of_memory import passes_report_memory

        return passes_report_memory(what, self.cfg, self.backend.memory_keys)

    def log_probs(self, batch: Any, weights: str | None = None, with_entropy: bool = False) -> Any:
        """``[B, T]`` log-probs of ``batch.tokens`` under the current (or a snapshot's) weights;
        with ``with_entropy``, ``(log_probs, entropy [B, T])``."""
        self.onload()
        with self._pass("log-prob"):
            log_probs, entropy = self.policy.log_probs(batch, weights=weights, with_entropy=with_entropy)
        return (log_probs, entropy) if with_entropy else log_probs

    def values(self, batch: Any) -> Any:
        """``[B, T]`` critic values."""
        self.onload()
        with self._pass("critic value"):
            return self.critic.values(batch)

    def importance_weights(self, batch: Any, rollout_log_probs: Any) -> tuple[Any, dict[str, float]]:
        """The configured correction's ``is_weights [B, T]`` from ``batch.old_log_probs`` vs the engine's."""
        return self.correction(batch.old_log_probs, rollout_log_probs, batch.response_mask)

    # ---------------------------------------------------------------- training
    def train(self, batch: Any, keep_log_probs: bool = False) -> Any:
        """``trainer.steps_per_rollout`` optimizer steps over consecutive slices of ``batch``
        (``global_batch_size`` samples each); the critic first when there is one. Mean metrics.

        ``keep_log_probs`` (one step only): ``(metrics, log_probs [B, T], entropy [B, T])``, the policy's
        before the step, from its training forward where the backend's model offers that
        (``trains_with_log_probs``), else from a :meth:`log_probs` pass first."""
        self.onload()
        steps = self.cfg.trainer.steps_per_rollout
        if keep_log_probs and steps != 1:
            raise ValueError("train(keep_log_probs=True) needs trainer.steps_per_rollout 1")
        size = len(batch) // steps
        totals: dict[str, float] = {}
        kept: tuple = ()
        for i in range(steps):
            part = batch.select(i * size, (i + 1) * size)
            metrics = {}
            with self._pass("train"):
                if self.critic is not None:
                    metrics.update({f"critic/{k}": v for k, v in self.critic.train_step(part).items()})
                if keep_log_probs and getattr(self.policy, "trains_with_log_probs", False):
                    policy_metrics, *kept = self.policy.train_step(part, self.loss, keep_log_probs=True)
                else:
                    if keep_log_probs:
                        kept = self.policy.log_probs(part, with_entropy=True)
                    policy_metrics = self.policy.train_step(part, self.loss)
            metrics.update(policy_metrics)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value / steps
        totals.update(self._flops(batch))
        return (totals, *kept) if keep_log_probs else totals

    def _flops(self, batch: Any) -> dict[str, float]:
        """The step's model FLOPs, one device's peak and the device count (``core.flops``: ``perf/mfu``)."""
        import torch.distributed as dist

        from posttrain.core.flops import peak_flops, train_flops

        peak = peak_flops(self.policy.device, self.cfg.trainer.peak_tflops)
        out = {"model_flops": train_flops(self.spec.hf_config(), batch.lengths.tolist()),
               "devices": float(dist.get_world_size() if dist.is_initialized() else 1)}
        return {**out, "peak_flops": peak} if peak else out

    # ---------------------------------------------------------------- weights out
    def save_hf(self, out_dir: str, replace: bool = False) -> str:
        """An HF checkpoint of the current policy (engines start from it), tokenizer included. In a group,
        data-parallel replica 0 gathers the shards (a collective over its ranks) and rank 0 writes.
        ``replace``: written beside ``out_dir`` and renamed to it (a directory there before is removed), so
        ``out_dir`` appears whole: engines launched before it exists wait for it and load it then."""
        from posttrain.core.hf_init import write_tokenizer

        if self.replica != 0:  # the other replicas hold the same weights
            return str(out_dir)
        final, out_dir = str(out_dir), f"{out_dir}.partial" if replace else str(out_dir)
        if replace and self.rank == 0:  # the one writer: nothing left of a start that died mid-write
            shutil.rmtree(out_dir, ignore_errors=True)
        with self._on_device():
            self.policy.save_hf(out_dir)
        if self.rank != 0:
            return final
        write_tokenizer(self.spec, out_dir)
        if replace:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(out_dir, final)  # atomic: a reader sees no directory, or all of it
        return final

    def connect_engines(self, engine_urls: list[str], backend: str | None = None, api_key: str | None = None) -> None:
        """Open the weight-update group with every engine (the trainer is rank 0; each engine adds its
        backend's ``ranks_per_engine``). ``backend``: NCCL when the trainer and the engines are on GPUs,
        else Gloo (only ``weight_sync: distributed`` opens one). ``api_key``: the engines' key (kept for
        later reconnections)."""
        from posttrain.core.rollout.weight_sync import WeightSender

        self.api_key = api_key or self.api_key
        self.full_push_due = True  # new or restarted engines: they need the base weights again
        if self.rank != 0:  # one sender: global rank 0 (the other ranks help gather the shards)
            return
        if self.sender is not None:
            self._leave_group()
        if backend is None:
            on_gpus = self.policy.device.type == "cuda" and self.engine_backend.on_gpu(self.cfg.resources)
            backend = "nccl" if on_gpus else "gloo"
        self.sender = WeightSender(engine_urls, backend=backend, api_key=self.api_key,
                                   timeout_s=self.cfg.rollout.weight_sync_timeout_s,
                                   ranks_per_engine=self.engine_backend.ranks_per_engine(self.cfg.resources),
                                   flat=self.engine_backend.flat_weight_buckets)
        if self.weight_sync == "distributed":
            self.sender.init()

    @property
    def weight_sync(self) -> str:
        return self.cfg.weight_sync_mode()

    def push_weights(self, version: int, disk_dir: str | None = None) -> tuple[float, int]:
        """New weights to the engines under their HF names, by ``rollout.weight_sync``: ``distributed``
        broadcasts buckets over the group, ``tensor`` hands colocated engines CUDA IPC handles bucket by
        bucket, ``disk`` writes an HF checkpoint to ``disk_dir`` that the engines load. ``(seconds taken,
        bytes pushed)``: the buckets' tensor bytes (one copy, whatever the engine count), or the safetensors
        written for ``disk``.

        In a group, the ranks of data-parallel replica 0 gather each bucket from their TP shards and PP
        stages (``export_hf``, one bucket in memory at a time) and rank 0 sends it.
        """
        import time

        start = time.perf_counter()
        self.onload()
        if self.replica != 0:
            return 0.0, 0
        bucket = int(self.cfg.rollout.weight_bucket_mb * (1 << 20))
        mode, sent = self.weight_sync, 0
        if mode == "disk":
            self.save_hf(disk_dir)
            if self.rank == 0:
                self.sender.update_from_disk(disk_dir, version=version)
                sent = sum(f.stat().st_size for f in Path(disk_dir).glob("*.safetensors"))
        elif mode == "tensor":  # every bucket sets the same version (idempotent)
            sent = self._each_bucket(self._update_buckets(bucket),
                                     lambda named: self.sender.update_from_tensors(named, version=version))
        else:
            sent = self._each_bucket(self._update_buckets(bucket),
                                     lambda named: self.sender.send([named], version=version))
        self.full_push_due = False
        if self.cfg.rollout.check_weights:
            self.check_weights(version)
        return time.perf_counter() - start, sent

    def _update_buckets(self, bucket: int) -> Any:
        """The push's buckets: ``export_update(bucket, full)`` of a model that has it, to engines that merge adapters
        (LoRA: the base weights and adapters on a first push, then adapters only; :mod:`posttrain.core.lora`), else
        ``export_hf`` (the merged weights)."""
        if hasattr(self.policy, "export_update") and getattr(self.engine_backend, "merges_adapters", False):
            return self.policy.export_update(bucket, self.full_push_due)
        return self.policy.export_hf(bucket)

    def check_weights(self, version: int) -> None:
        """``rollout.check_weights``: every engine must hold what was just pushed; raises
        :class:`~posttrain.core.rollout.weight_check.WeightMismatch` naming the first differing tensor. In a
        group every rank of replica 0 gathers the weights (a collective: the whole model once, a test
        setting), rank 0 compares."""
        from posttrain.core.rollout.weight_check import WeightMismatch

        bucket = int(self.cfg.rollout.weight_bucket_mb * (1 << 20))
        buckets = list(self.policy.export_hf(bucket))
        if self.rank != 0:
            return
        for url in self.sender.engine_urls:
            problem = self.engine_backend.check_weights(url, self.api_key, iter(buckets))
            if problem is not None:
                raise WeightMismatch(f"rollout.check_weights: engine {url} after push {version}: {problem}")

    def _each_bucket(self, buckets: Any, send: Any) -> int:
        """``send(bucket)`` on rank 0 for every bucket; the tensor bytes sent. Every rank walks every bucket
        even after a failed send, because gathering a bucket is a collective over the ranks holding its
        shards: a rank that stopped early would leave the others waiting. The first failure is raised at the end."""
        error, sent = None, 0
        for named in buckets:
            if self.rank == 0 and error is None:
                try:
                    send(named)
                    sent += sum(t.numel() * t.element_size() for _, t in named)
                except RuntimeError as exc:
                    error = exc
        if error is not None:
            raise error
        return sent

    def offload(self) -> float:
        """The models' weights, optimizer state and snapshots to host memory, their gradients freed
        (``resources.offload_trainer``: colocated engines generate in the room). GiB freed on the device. Every
        later call that needs the models brings them back first (:meth:`onload`)."""
        if self.offloaded:
            return 0.0
        from posttrain.core.gpu_memory import GIB

        freed = sum(model.offload() for model in (self.policy, self.critic) if model is not None)
        self.offloaded = True
        return freed / GIB

    def onload(self) -> None:
        """Back on the device after :meth:`offload` (else nothing to do)."""
        if self.offloaded:
            for model in (self.policy, self.critic):
                if model is not None:
                    model.onload()
            self.offloaded = False

    @contextmanager
    def _on_device(self):
        """The models on the device inside, and back in host memory after if they were there before."""
        was = self.offloaded
        self.onload()
        try:
            yield
        finally:
            if was:
                self.offload()

    def release_memory(self) -> None:
        """Return cached, unused GPU memory to the driver (colocated engines resume into it)."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def memory_stats(self) -> dict[str, float]:
        """Peak and current GPU memory of this process (GiB), and two counts since the start that explain a
        slow train phase: ``alloc_retries`` (the allocator found no free block, gave its whole cache back to
        the driver and asked again: a device-wide wait each time, from fragmentation near the memory's limit)
        and ``compiled_graphs`` (graphs Dynamo compiled in this process: one that rises after the first steps
        is a recompile). Empty on CPU."""
        import sys

        import torch

        if not torch.cuda.is_available():
            return {}
        dynamo = sys.modules.get("torch._dynamo.utils")  # loaded only by a compiled trainer
        return {"peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "allocated_gib": torch.cuda.memory_allocated() / 2**30,
                "reserved_gib": torch.cuda.memory_reserved() / 2**30,  # allocated + the allocator's cache
                "alloc_retries": float(torch.cuda.memory_stats().get("num_alloc_retries", 0)),
                "compiled_graphs": float(dynamo.counters["stats"]["unique_graphs"]) if dynamo else 0.0}

    # ---------------------------------------------------------------- checkpoints
    def save(self, ckpt_dir: str) -> None:
        with self._on_device():
            self.policy.save(Path(ckpt_dir) / "policy")
            if self.critic is not None:
                self.critic.save(Path(ckpt_dir) / "critic")

    def load(self, ckpt_dir: str) -> None:
        self.onload()
        self.policy.load(Path(ckpt_dir) / "policy")
        if self.critic is not None:
            self.critic.load(Path(ckpt_dir) / "critic")

    def _leave_group(self) -> None:
        try:
            self.sender.destroy()
        except RuntimeError as exc:  # an engine that died (or was restarted) cannot leave a group: expected
            import logging

            logging.getLogger("posttrain.trainer").info("weight-update group teardown: %s", exc)
        self.sender = None

    def close(self) -> None:
        if self.sender is not None:
            self._leave_group()
