"""Checkpoints of a :class:`~posttrain.plugins.trainers.megatron.trainer.MegatronTrainer` with Megatron's
dist-checkpointing (torch_dist): model shards, optimizer state (Megatron's distributed optimizer on GPU,
torch AdamW with fp32 masters on CPU), the step, and the critic's value head. Functions of the trainer
(``self``), kept apart so the trainer class stays readable."""

from __future__ import annotations

import contextlib
import warnings

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.errors import UsageError
from posttrain.core.rollout.procs import forks_die_with_parent, watch_parent
from posttrain.plugins.trainers.megatron.optim import init_adam_state


def sharded_state(self: Any, is_loading: bool) -> dict[str, Any]:
    """The trainer's state as Megatron sharded tensors (what ``dist_checkpointing`` saves and loads)."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    model_sd = model_state(self)
    state: dict[str, Any] = {"model": model_sd, "step": self.step}
    if self.value_head is not None:
        state["value_head"] = {k: v.detach().cpu() for k, v in self.value_head.state_dict().items()}
    if self.megatron_optimizer:
        # dp_reshardable: each rank saves its own optimizer shards, in parallel. Megatron-core 0.16's
        # default (fully_sharded_model_space) builds flattened ShardedTensors that its own checker
        # refuses ("ShardedTensor.flattened_range is not supported").
        # Without TE/Apex, Megatron reads the step from torch's AdamW state, which exists only after a
        # first step: a fresh trainer loading a checkpoint needs it made. Megatron's distributed
        # optimizer (0.16, dp_reshardable) restores the moments but not that step counter (0 after a
        # load on a GPU), so it travels beside them as "adam_steps".
        adams = torch_adams(self)
        for adam in adams:
            init_adam_state(adam)
        state["adam_steps"] = [max((float(st["step"]) for st in adam.state.values()), default=0.0)
                               for adam in adams]
        state["optimizer"] = self.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        return state
    # Every parameter gets a state, also those without gradients so far (the critic never uses the
    # output layer), so saved and loading structures agree.
    init_adam_state(self.optimizer)
    optim = self.optimizer.state_dict()
    optim["state"] = {pid: dict(s) for pid, s in optim["state"].items()}  # torch shares the live dicts
    gpt_params = [p for p in self.gpt.parameters() if p.requires_grad]
    id_map = get_param_id_to_sharded_param_map(model_sd, gpt_params)
    head_ids = set(range(len(gpt_params), len(self._params())))  # the critic's replicated fp32 head
    if head_ids:  # plain tensors in the common part, not sharded
        state["value_head_optimizer"] = {pid: {k: v.detach().cpu().clone() for k, v in optim["state"][pid].items()}
                                         for pid in head_ids if pid in optim["state"]}
        optim["state"] = {pid: st for pid, st in optim["state"].items() if pid not in head_ids}
    steps = {pid: st.pop("step") for pid, st in optim["state"].items() if "step" in st}
    if self._masters is not None:  # fp32 master weights travel sharded like the moments
        for pid, master in enumerate(self._masters[: len(gpt_params)]):
            optim["state"].setdefault(pid, {})["master_param"] = master.detach()
    optim_state_to_sharding_state(optim, id_map)
    optim.pop("param_groups")  # ids differ per pipeline stage: rebuilt from the live optimizer on load
    state["optimizer"] = optim
    state["optimizer_step"] = max((float(v) for v in steps.values()), default=0.0)
    return state


def model_state(self: Any) -> dict[str, Any]:
    """The model's sharded tensors; with LoRA its adapters only (the frozen base comes from the spec at build)."""
    state = self.gpt.sharded_state_dict(prefix="model.")
    if self.lora_modules:
        state = {k: v for k, v in state.items() if ".lora_" in k}
    return state


def torch_adams(self: Any) -> list[torch.optim.Optimizer]:
    """The torch Adam(W) instances inside Megatron's (chained) optimizer."""
    chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
    inners = [getattr(o, "optimizer", None) for o in chained]
    return [o for o in inners if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]


def check_same_model(self: Any, ckpt_dir: str | Path) -> None:
    """Refuse a checkpoint of another model (UsageError) before loading anything: every model tensor
    the checkpoint holds must be one of this model's, with the same global shape (layers stacked, so a
    checkpoint with more or fewer layers differs too), and the other way round (on one pipeline stage:
    only the tensors it holds). Dist-checkpointing alone would load the subset this model asks for and
    ignore the rest."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    saved = {k: tuple(v.global_shape) for k, v in load_tensors_metadata(str(ckpt_dir)).items()
             if k.startswith("model.") and isinstance(v, ShardedTensor)}
    mine = model_state(self)
    apply_factories(mine)  # fused weights (SwiGLU's fc1) become the tensors that are saved
    tensors = [v for v in nested_values(mine) if isinstance(v, ShardedTensor)]
    want = {v.key: tuple(v.global_shape) for v in tensors}
    # Megatron marks the vocabulary-padded tensors (embedding, output layer) allow_shape_mismatch: their
    # rows are padded to a multiple of 128 x TP, so a layout change changes dim 0 and the rows load as saved
    rows_may_differ = {v.key for v in tensors if getattr(v, "allow_shape_mismatch", False)}

    def compared(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[1:] if key in rows_may_differ else shape

    # a pipeline stage holds only its own layers: the checkpoint's others are not this rank's to compare
    whole = parallel_state.get_pipeline_model_parallel_world_size() == 1
    unmatched = (set(saved) ^ set(want)) if whole else (set(want) - set(saved))
    diff = sorted(unmatched) or sorted(k for k in want if compared(k, saved[k]) != compared(k, want[k]))
    if diff:
        raise UsageError(f"{ckpt_dir}: written by another model: {diff[0]} is {saved.get(diff[0], 'absent')} "
                         f"there and {want.get(diff[0], 'absent')} in this model ({len(diff)} tensor(s) differ)")


def save(self: Any, ckpt_dir: str | Path) -> None:
    """Model + optimizer + step with Megatron dist-checkpointing (torch_dist); collective."""
    from megatron.core import dist_checkpointing

    path = Path(ckpt_dir)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    forks_die_with_parent()  # the torch_dist writer forks workers: they must not outlive a killed run
    _writer_queue_dies_with_us()
    with quiet_sharded_tensor():
        dist_checkpointing.save(sharded_state(self, is_loading=False), str(path))


def _writer_queue_dies_with_us() -> None:
    """Megatron's torch_dist writer collects results through a queue of a spawned multiprocessing Manager
    (``filesystem_async._get_write_results_queue``): a server process that outlives a run killed with
    SIGKILL (and keeps its resource tracker alive). Give the writer the queue of a Manager whose server
    exits once this process is gone (:func:`watch_parent`). Left alone where Megatron has no such queue."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", "absent") is not None:  # made already, or none to make
        return
    import multiprocessing
    import os
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=watch_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


def load(self: Any, ckpt_dir: str | Path) -> None:
    """Restore what :meth:`save` wrote (same spec; TP may differ for the model weights)."""
    from megatron.core import dist_checkpointing

    if not Path(ckpt_dir).is_dir():
        raise UsageError(f"{ckpt_dir}: no such checkpoint directory")
    check_same_model(self, ckpt_dir)
    with quiet_sharded_tensor():
        loaded = dist_checkpointing.load(sharded_state(self, is_loading=True), str(ckpt_dir))
    model_sd = {k.removeprefix("model."): v for k, v in loaded["model"].items()}
    # not strict only for TE's _extra_state entries; check_same_model compared every tensor already
    result = self.gpt.load_state_dict(model_sd, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")
               and (".lora_" in k or not self.lora_modules)]
    if missing:
        raise UsageError(f"{ckpt_dir}: checkpoint lacks {missing[:3]} (written by another model spec?)")
    self.step = int(loaded["step"])
    if self.value_head is not None:
        self.value_head.load_state_dict(loaded["value_head"])
    if self.megatron_optimizer:
        self.optimizer.load_state_dict(loaded["optimizer"])
        for adam, step in zip(torch_adams(self), loaded.get("adam_steps", [])):
            for st in adam.state.values():
                st["step"] = torch.full_like(st["step"], step) if torch.is_tensor(st["step"]) else step
        return
    optim = loaded["optimizer"]
    optim["param_groups"] = self.optimizer.state_dict()["param_groups"]
    step = torch.tensor(loaded["optimizer_step"])
    if self._masters is not None:
        with torch.no_grad():
            for pid, master in enumerate(self._masters):
                saved = optim["state"].get(pid, {}).pop("master_param", None)
                params = self._params()
                master.copy_(saved if saved is not None else params[pid].detach().float())
    for pid in optim["state"]:
        optim["state"][pid]["step"] = step.clone()
    for pid, s in (loaded.get("value_head_optimizer") or {}).items():
        optim["state"][pid] = s
    self.optimizer.load_state_dict(optim)


@contextlib.contextmanager
def quiet_sharded_tensor():
    """Megatron's torch_dist format goes through ShardedTensor and ``torch.distributed.checkpoint``'s
    ``load_state_dict``, which PyTorch warns are deprecated on every save and load (a FutureWarning each): a
    user's resume or export printed them as if something were wrong. Only those warnings are silenced, only
    here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning)
        yield
