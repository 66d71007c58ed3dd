"""A trainer's state in host memory while colocated engines generate (``resources.offload_trainer``).

On a colocated GPU the trainer's weights, gradients, optimizer state and resident reference weights stay
on the device through generation unless moved: about 40 GiB at Qwen3-1.7B with Adam on one H200
(bench/RESULTS.md), so the engine's KV cache gets that much less and larger models do not fit at all.
slime forces this offload on colocated runs (``torch_memory_saver``, intercepting ``cudaMalloc``); verl's
Megatron workers move parameters, gradients and optimizer state by flags. Here it is per storage:

- a storage whose values must survive (weights, fp32 master copies, Adam's moments, snapshots) is copied into
  pinned host memory (one buffer, kept from one step to the next: pinning 30 GB costs seconds) and then freed on the
  device with ``untyped_storage().resize_(0)``; :meth:`HostOffload.onload` re-allocates it and copies it back;
- a storage whose values need not survive (gradient buffers: every train step zeroes them first) is freed and
  comes back zeroed, never copied.

``trainer.backend.offload_parts`` picks which of them move (:func:`state_tensors`); what stays costs no copy. A bf16
model on Megatron's optimizer holds 20 bytes a parameter: weights 2, resident reference 2, fp32 gradients 4, fp32
masters 4, Adam's moments 8. Every part frees all 20 and copies 16 each way; ``[optimizer, grads]`` frees 16 and copies
12, the weights and the reference staying on the device.

Every tensor keeps its identity: a parameter that is a view into Megatron's contiguous parameter buffer, a
``main_grad`` into its gradient buffer, an optimizer's state, all see their storage come back in place (Megatron's
own ``_ParamAndGradBuffer.offload_to_cpu`` frees its buffers the same way). Between :meth:`offload` and
:meth:`onload` nothing may touch those tensors. Device pointers change across the round trip, so nothing may
keep one (the trainer captures no CUDA graphs).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from posttrain.plugins.trainers.megatron import OFFLOAD_PARTS

log = logging.getLogger("posttrain.trainer")


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """``storage`` as a flat uint8 tensor (``[nbytes]``), for copies of the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _empty_host_cache() -> None:
    """Give PyTorch's cached pinned blocks back to the system (``torch.accelerator.empty_host_cache``, or the older
    private call); without either, a replaced host buffer stays pinned beside its successor."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


class HostOffload:
    """Moves the storages of given tensors off ``device`` and back (module docstring). One instance per
    model: one pinned host buffer holds every kept storage back to back, reused by every later :meth:`offload`
    of the same storages (one allocation: PyTorch's pinned allocator rounds each block up to a power of two)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.moved: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []  # storage, bytes, host copy
        self._host: torch.Tensor | None = None  # the kept storages' bytes, back to back, reused across steps

    @property
    def offloaded(self) -> bool:
        return bool(self.moved)

    def _storages(self, tensors: Iterable[torch.Tensor | None]) -> dict[int, torch.UntypedStorage]:
        out: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            if t is None or t.device != self.device:
                continue
            storage = t.untyped_storage()
            if storage.nbytes():
                out.setdefault(storage.data_ptr(), storage)  # views of one buffer: moved once
        stuck = [s for s in out.values() if not s.resizable()]  # memory someone else owns (numpy, mmap, IPC)
        if stuck:
            log.warning("offload: %d storages (%.1f MiB) cannot be freed in place and stay on %s", len(stuck),
                        sum(s.nbytes() for s in stuck) / 2**20, self.device)
        return {ptr: s for ptr, s in out.items() if s.resizable()}

    def offload(self, keep: Iterable[torch.Tensor | None], drop: Iterable[torch.Tensor | None] = ()) -> int:
        """Free the device storages of ``keep`` (values copied to host memory first) and of ``drop`` (values
        lost: zeros after :meth:`onload`); a storage in both is kept. Returns the bytes freed on the device."""
        if self.moved:
            raise RuntimeError("HostOffload.offload: already offloaded (onload first)")
        kept = self._storages(keep)
        dropped = {ptr: s for ptr, s in self._storages(drop).items() if ptr not in kept}
        pin = self.device.type == "cuda"
        total = sum(s.nbytes() for s in kept.values())
        if self._host is None or self._host.numel() != total:  # the first offload, or other storages
            if self._host is not None:  # (the first offload precedes the optimizer's first step: no Adam state yet)
                self._host = None  # the old buffer goes before the new one is pinned, and leaves the pinned cache
                if pin:
                    _empty_host_cache()
            self._host = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        at = 0
        for storage in kept.values():
            nbytes = storage.nbytes()
            host = self._host[at: at + nbytes]
            host.copy_(_bytes_view(storage, self.device), non_blocking=pin)
            self.moved.append((storage, nbytes, host))
            at += nbytes
        self.moved += [(storage, storage.nbytes(), None) for storage in dropped.values()]
        if pin:  # the copies read the device memory about to be freed
            torch.cuda.synchronize(self.device)
        freed = 0
        for storage, nbytes, _ in self.moved:
            storage.resize_(0)
            freed += nbytes
        if pin:
            torch.cuda.empty_cache()  # back to the driver, where the engines take it
        return freed

    def onload(self) -> int:
        """Re-allocate every freed storage in place and copy the kept values back; returns the bytes."""
        pin = self.device.type == "cuda"
        total = 0
        for storage, nbytes, host in self.moved:
            storage.resize_(nbytes)
            view = _bytes_view(storage, self.device)
            if host is None:
                view.zero_()
            else:
                view.copy_(host, non_blocking=pin)
            total += nbytes
        if pin:  # the host buffers are overwritten by the next offload
            torch.cuda.synchronize(self.device)
        self.moved = []
        return total


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (chained or not), or ``optimizer`` itself."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [inner for one in chained for inner in torch_optimizers(getattr(one, "optimizer", None))]


def state_tensors(trainer, parts: Iterable[str] = OFFLOAD_PARTS) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """``(keep, drop)`` of a :class:`~posttrain.plugins.trainers.megatron.trainer.MegatronTrainer` for
    :meth:`HostOffload.offload`, of the ``parts`` asked (``trainer.backend.offload_parts``):

    - ``weights``: the model's (and a critic's value head's) parameters and buffers, kept;
    - ``reference``: the snapshots kept on the device (the reference policy's weights), kept;
    - ``optimizer``: the optimizers' parameters (fp32 masters or their shards: the CPU path's AdamW steps its master
      copies) and state (Adam's moments, step counters), kept;
    - ``grads``: every gradient (``grad``, Megatron's ``main_grad`` views of its gradient buffers), dropped: each train
      step zeroes them before its first backward.

    A storage is one part's only: an optimizer's parameter that shares the model's storage (no master copies: fp32
    weights) is a weight, and moves only with ``weights``."""
    parts = set(parts)
    modules = [m for m in (trainer.model, trainer.value_head) if m is not None]
    weights = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    grads = [g for m in modules for p in m.parameters() for g in (p.grad, getattr(p, "main_grad", None))]
    optimizer: list[torch.Tensor] = []
    for opt in torch_optimizers(trainer.optimizer) + torch_optimizers(getattr(trainer, "head_optimizer", None)):
        for group in opt.param_groups:
            optimizer += group["params"]
            grads += [p.grad for p in group["params"]]
        optimizer += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    weight_storages = {t.untyped_storage().data_ptr() for t in weights}
    optimizer = [t for t in optimizer if t.untyped_storage().data_ptr() not in weight_storages]
    reference = [t for saved in trainer._snapshots.saved.values() for t in saved.values()]
    keep = [t for part, tensors in (("weights", weights), ("reference", reference), ("optimizer", optimizer))
            if part in parts for t in tensors]
    return keep, grads if "grads" in parts else []
