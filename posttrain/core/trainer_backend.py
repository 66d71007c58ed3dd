"""Trainer backends: the interface a ``posttrain_register_trainers`` plugin implements.

A trainer backend owns the model the loop trains: building it from a model spec, log-probs, the train
step, checkpoints, HF export, and the sending side of weight sync (it yields HF-named tensors; the
weight-sync protocol in :mod:`posttrain.core.rollout.weight_sync` delivers them). The built-in is
``megatron`` (:mod:`posttrain.plugins.trainers.megatron`); a plain-PyTorch or FSDP2 backend plugs in the
same way. The run config selects it and passes its own keys to its ``Config``, while the algorithm's
keys (batch sizes, lr, KL, entropy, clipping, Adam) stay in ``trainer`` for every backend::

    trainer:
      lr: 1.0e-6
      global_batch_size: 512
      backend: {name: megatron, tp: 2, compile: true}

A backend class is built like every component, ``Backend(Backend.Config(...))``; ``build`` then makes a
model of one role::

    class MyTrainer(TrainerBackend):
        name = "my_trainer"

        def build(self, spec, run, role="actor", seed=0):
            return MyModel(spec, run.trainer, self.config, seed=seed, role=role)

The model ``build`` returns implements (shapes: ``[B, T]`` tensors aligned with ``batch.tokens``, see
:class:`~posttrain.core.train_batch.TrainBatch`; results are CPU tensors or ``dict[str, float]``):

- ``device``: a ``torch.device``;
- ``log_probs(batch, *, with_entropy=False, weights=None) -> (log_probs, entropy or None)``:
  float32 ``[B, T]``, ``log_probs[b, t] = log_softmax(z[b, t - 1])[tokens[b, t]]``, exactly 0 at column 0
  and past ``batch.lengths[b]`` (prompt columns hold values the losses mask out); ``weights="ref"`` uses
  the reference policy (the initial weights, kept by the model when ``run.trainer.uses_reference``: the loop
  asks for it only then, so a model may skip the copy otherwise);
- ``values(batch) -> [B, T]`` (critic role only);
- ``train_step(batch, loss_fn) -> metrics``: one optimizer step over ``batch``, micro-batched as the
  backend likes. ``loss_fn`` is the run's policy loss (``posttrain.core.losses.PolicyLoss``); the
  backend adds the KL and entropy terms with ``posttrain.core.losses.total_loss`` (one implementation,
  the loss's aggregation mode) from ``run.trainer`` (``kl_loss_coef``, ``kl_kind``, ``entropy_coef``),
  clips gradients to ``grad_clip`` and follows the lr schedule (``lr_at``). Metrics include ``loss``,
  ``grad_norm``, ``lr`` and the loss's own (prefixed ``pg/``);
- ``export_hf(bucket_bytes) -> iterator of [(hf_name, tensor)]`` buckets of the current weights under
  HF names, and ``save_hf(out_dir)``: an HF checkpoint (``config.json`` + safetensors);
- ``save(dir)`` / ``load(dir)``: the whole training state (weights, optimizer, step), for resume;
- with ``offloads = True`` on the backend class (``resources.offload_trainer``), ``offload() -> bytes`` and
  ``onload()``: the model's device state to host memory while colocated engines generate, and back in place
  (the model is not used in between: the trainer role brings it back first for any call, a save included).

A backend may name, in ``memory_keys``, its config keys that make a pass take less memory: when a pass runs out of
GPU memory the run ends with one line naming them and the core's micro-batch keys, with their values
(:mod:`posttrain.core.out_of_memory`).

``posttrain.testing.TrainerContract`` checks all of it on the tiny model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from posttrain.core.errors import UsageError
from posttrain.core.interfaces import Component


class TrainerBackend(Component):
    """Base of every trainer backend. Subclasses set ``name`` and ``Config`` and implement ``build``."""

    name = ""
    offloads = False  # whether its models implement offload()/onload() (resources.offload_trainer)
    exact_mode = False  # rollout.exact: its forward computes with core.exact's arithmetic (build reads run.rollout.exact)
    # dotted config keys that make a pass take less memory, named with their values when one runs out of it
    # (core.out_of_memory; the core's micro-batch keys come first)
    memory_keys: tuple[str, ...] = ()

    @dataclass
    class Config:
        pass

    def logits_chunk_tokens(self) -> int | None:
        """Tokens per chunk of the log-softmax over the vocabulary, where the backend computes it in chunks
        (``trainer.max_tokens_per_micro_batch: auto`` then plans one chunk's fp32 logits, not a pass's).
        Default: None, no chunks."""
        return None

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        """Problems with this backend for ``run`` (a validated RunConfig), as ``key: reason`` lines
        reported with every other config error before anything starts. Default: none."""
        return []

    def offloaded_bytes_per_parameter(self, run: Any) -> float:
        """Host bytes a parameter of ``run``'s model takes while ``resources.offload_trainer`` holds the model's
        state in host memory (``rl-cli doctor``'s floor for it). Default 16: bf16 weights and reference weights, fp32
        master weights and Adam's two moments."""
        return 16.0

    @property
    def needs_routed_experts(self) -> bool:
        """Whether the backend replays the engines' MoE routing (``Sample.rollout_routed_experts``, asked of
        the engines with ``return_routed_experts``). Default: no."""
        return False

    def on_gpu(self) -> bool:
        """Whether the model trains on CUDA (weight sync then uses NCCL or CUDA IPC)."""
        import torch

        return torch.cuda.is_available()

    def build(self, spec: Any, run: Any, role: str = "actor", seed: int = 0) -> Any:
        """The model of ``role`` (``actor``, or ``critic`` for estimators whose ``needs.critic`` is set) from
        the model spec instance ``spec`` and the whole run config ``run``."""
        raise NotImplementedError

    # ---- ``rl-cli models verify / convert``: optional, for backends with their own checkpoint format ----

    def verify_hf(self, spec: Any, hf_dir: str, *, tp: int = 1, ep: int = 1, pp: int = 1, tolerance: float = 1e-4,
                  seq_len: int = 16, attention: str = "auto") -> dict[str, Any] | None:
        """Load the HF checkpoint ``hf_dir`` into this backend's model of ``spec`` (this process's rank of a
        ``tp x ep x pp`` group) and compare its logits with transformers' on the same tokens. Rank 0 returns
        ``{"max_abs_diff", "tolerance", "passed", "round_trip_exact", "round_trip_mismatches"}``, others None."""
        raise UsageError(f"trainer backend {self.name!r} cannot verify HF checkpoints")

    def checkpoint_from_hf(self, spec: Any, hf_dir: str, out: str, *, tp: int = 1) -> bool:
        """Write ``out`` in this backend's checkpoint format from the HF checkpoint ``hf_dir``; True on the
        process that reports (rank 0)."""
        raise UsageError(f"trainer backend {self.name!r} has no checkpoint format to convert to")

    def checkpoint_meta(self, src: str) -> dict[str, Any]:
        """``{"spec", "dtype", "hf_config"}`` of a checkpoint :meth:`checkpoint_from_hf` (or a run) wrote."""
        raise UsageError(f"trainer backend {self.name!r} has no checkpoint format to convert from")

    def checkpoint_to_hf(self, spec: Any, src: str, out: str, hf_config: dict[str, Any], *, tp: int = 1) -> bool:
        """Write the HF checkpoint ``out`` from this backend's checkpoint ``src``; True on rank 0."""
        raise UsageError(f"trainer backend {self.name!r} has no checkpoint format to convert from")


def lr_at(step: int, config: Any) -> float:
    """Learning rate for optimizer step ``step`` (0-based) under ``trainer`` config ``config``: linear
    warm-up over ``lr_warmup_steps``, then constant, linear or cosine decay to ``min_lr`` at
    ``lr_decay_steps``. Every backend follows it, so a run's lr curve does not depend on the backend."""
    lr = config.lr
    if config.lr_warmup_steps and step < config.lr_warmup_steps:
        return lr * (step + 1) / config.lr_warmup_steps
    if config.lr_decay_style == "constant":
        return lr
    span = max(1, config.lr_decay_steps - config.lr_warmup_steps)
    frac = min(1.0, max(0.0, (step - config.lr_warmup_steps) / span))
    if config.lr_decay_style == "linear":
        return config.min_lr + (lr - config.min_lr) * (1 - frac)
    return config.min_lr + (lr - config.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
