"""A trainer's state in host memory while colocated engines generate (``resources.offload_trainer``).

On a colocated GPU the trainer's weights, gradients, optimizer state and resident reference weights stay
on the device through generation unless moved: about 40 GiB at Qwen3-1.7B with Adam, so the engine's KV cache
gets that much less and larger models do not fit at all.
slime forces this offload on colocated runs (``torch_memory_saver``, intercepting ``cudaMalloc``); verl's
Megatron workers move parameters, gradients and optimizer state by flags. Here it is per storage:

- a storage whose values must survive (weights, fp32 master copies, Adam's moments, snapshots) is copied into
  pinned host memory (one buffer of the exact size, kept from one step to the next: host_memory.py makes it) and
  then freed on the device with ``untyped_storage().resize_(0)``; :meth:`HostOffload.onload` re-allocates it and
  copies it back;
- a storage whose values need not survive (gradient buffers: every train step zeroes them first) is freed and
  comes back zeroed, never copied.

``trainer.backend.offload_parts`` picks which of them move (:func:`state_parts`); what stays costs no copy. A bf16
model on Megatron's optimizer holds 20 bytes a parameter: weights 2, resident reference 2, fp32 gradients 4, fp32
masters 4, Adam's moments 8. Every part frees all 20 and copies 16 each way; ``[optimizer, grads]`` frees 16 and copies
12, the weights and the reference staying on the device.

The optimizer's state moves in the background (``trainer.backend.offload_overlap``, :class:`TrainerOffload`), on a
side stream: back behind the step's log-prob and forward/backward passes, which never read it (the optimizer step, and
a checkpoint's save or load, wait for it), and out with the weight push (:meth:`HostOffload.copy_out`; the offload
then waits for that copy and frees). With Adam that is 12 of the 16 bytes a parameter copied each way. The copies back
start only once the first pass has its inputs on the device (:meth:`HostOffload.start`): a copy engine serves its
direction's copies in order, so a pass's few kilobytes queued behind 20 GB of state would wait for all of it.
The copy out waits for the push because the loop gives the trainer's cache back to the driver just before it, and that
``cudaFree`` waits for the whole device, a copy already running included.

Every tensor keeps its identity: a parameter that is a view into Megatron's contiguous parameter buffer, a
``main_grad`` into its gradient buffer, an optimizer's state, all see their storage come back in place (Megatron's
own ``_ParamAndGradBuffer.offload_to_cpu`` frees its buffers the same way). Between :meth:`offload` and
:meth:`onload` nothing may touch those tensors. Device pointers change across the round trip, so nothing may
keep one (the trainer captures no CUDA graphs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch

from posttrain.plugins.trainers.megatron.host_memory import pinned_empty
from posttrain.plugins.trainers.megatron.optim import init_adam_state

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
    of the same storages (making it is the slow part: host_memory.py)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors name their index: compare like that
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.moved: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []  # storage, bytes, host copy
        self._host: torch.Tensor | None = None  # the kept storages' bytes, back to back, reused across steps
        self._stream: torch.cuda.Stream | None = None  # a background onload's copies (CUDA)
        self._copied: torch.cuda.Event | None = None  # ... recorded after them, until the next offload
        self._waited = False  # the current stream already waits for that event
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # a background onload's copies, not yet queued
        self._asked: torch.cuda.Event | None = None  # recorded where the current stream started waiting for them
        self._stall_s: float | None = None  # off CUDA: how long the awaited copies took
        # copy_out's storages ((pointer, bytes) in host-buffer order) and its event (CUDA), until offload or a write
        self._early: tuple[list[tuple[int, int]], torch.cuda.Event | None] | None = None
        self._unpin: Callable[[], object] | None = None  # unregisters the host buffer (host_memory.pinned_empty)
        self.pin_s: float | None = None  # seconds the last new host buffer took to make, until read

    @property
    def offloaded(self) -> bool:
        return bool(self.moved)

    @property
    def has_host_buffer(self) -> bool:
        """Whether an :meth:`offload` ran before (its pinned buffer is kept for the next)."""
        return self._host is not None

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
        self.wait(writes=False)  # a background onload's copies read the host buffer and write the storages: done first
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        kept = self._storages(keep)
        dropped = {ptr: s for ptr, s in self._storages(drop).items() if ptr not in kept}
        pin = self.device.type == "cuda"
        total = sum(s.nbytes() for s in kept.values())
        early, self._early = self._early, None
        if early is not None and early[1] is not None:  # its reads of the storages, its writes to the host buffer
            early[1].synchronize()
        if early is None or early[0] != [(ptr, s.nbytes()) for ptr, s in kept.items()]:  # else: already copied
            if self._host is None or self._host.numel() != total:  # the first offload, or other storages
                if self._host is not None:  # (a state that grew: TrainerOffload makes Adam's ahead, so rarely)
                    self._drop_host()  # the old buffer goes before the new one is pinned
                self._host = self._new_host(total)
            self._copy_out(kept)
        at = 0
        for storage in kept.values():
            nbytes = storage.nbytes()
            self.moved.append((storage, nbytes, self._host[at: at + nbytes]))
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

    def _new_host(self, nbytes: int) -> torch.Tensor:
        """``[nbytes]`` uint8 host memory for the kept storages: page-locked on CUDA (host_memory.py: exact size, pages
        faulted in by several threads, then registered; ``cudaHostAlloc`` where registering fails)."""
        t0 = time.perf_counter()
        if self.device.type != "cuda":
            host = torch.empty(nbytes, dtype=torch.uint8)
        else:
            try:
                host, self._unpin, _ = pinned_empty(nbytes)
            except RuntimeError as exc:
                log.warning("offload: %s; pinning with cudaHostAlloc instead", exc)
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.pin_s = time.perf_counter() - t0
        return host

    def _drop_host(self) -> None:
        """Let the host buffer go: unregistered first (its memory may go back with it), or out of the pinned cache."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self._host = None
        if self.device.type == "cuda":
            _empty_host_cache()

    def onload(self, background: bool = False) -> int:
        """Re-allocate every freed storage in place and copy the kept values back; returns the bytes.

        ``background``: the copies are only planned; :meth:`start` queues them on a side stream (CUDA), so they
        overlap whatever the device does next, and :meth:`wait` must come before anything reads those storages (it
        starts them first if nothing did). Off CUDA the copies wait for :meth:`wait` itself, so what reads the
        storages too early reads garbage there as well (the CPU tests see it). The freed-only storages are zeroed at
        once either way."""
        pin = self.device.type == "cuda"
        total, copies = 0, []
        self._asked = self._stall_s = None  # an earlier wait's, already reported or not
        for storage, nbytes, host in self.moved:
            storage.resize_(nbytes)
            view = _bytes_view(storage, self.device)
            if host is None:
                view.zero_()
            else:
                copies.append((view, host))
            total += nbytes
        self.moved = []
        if background:
            self._pending = copies
            return total
        self._copy_back(copies)
        if pin:  # the host buffers are overwritten by the next offload
            torch.cuda.synchronize(self.device)
        return total

    def start(self) -> None:
        """Queue a background :meth:`onload`'s copies on the side stream, after the current stream's queued work (CUDA;
        off CUDA they stay for :meth:`wait`). Called once what must reach the device first is on its way."""
        if not self._pending or self.device.type != "cuda":
            return
        copies, self._pending = self._pending, []
        # (the blocks just allocated may be ones the current stream's queued kernels still use: after them)
        self._copied, self._waited = self._behind_current_stream(lambda: self._copy_back(copies), timing=True), False

    def copy_out(self, keep: Iterable[torch.Tensor | None]) -> bool:
        """Copy ``keep``'s storages into the host buffer ahead of the :meth:`offload` that will free them: on CUDA
        on the side stream, after the current stream's queued work, so it overlaps whatever comes next; that offload
        then waits for the copies and frees without copying. Only for the storages of the last offload, at the same
        sizes (else False, and nothing is done). A :meth:`wait` before a write to them drops the copy."""
        kept = self._storages(keep)
        layout = [(ptr, s.nbytes()) for ptr, s in kept.items()]
        if self.moved or self._host is None or sum(n for _, n in layout) != self._host.numel():
            return False
        event = None
        if self.device.type == "cuda":
            event = self._behind_current_stream(lambda: self._copy_out(kept))
        else:
            self._copy_out(kept)
        self._early = (layout, event)
        return True

    def _behind_current_stream(self, work: Callable[[], None], timing: bool = False) -> torch.cuda.Event:
        """``work``'s copies on the side stream, after the current stream's queued kernels (and whatever the side
        stream queued before); the event recorded after them (``timing``: one ``elapsed_time`` can read)."""
        self._stream = self._stream or torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            work()
            event = torch.cuda.Event(enable_timing=timing)
            event.record(self._stream)
        return event

    def _copy_out(self, kept: dict[int, torch.UntypedStorage]) -> None:
        """The storages into the host buffer, back to back in ``kept``'s order, on the current stream."""
        at, pin = 0, self.device.type == "cuda"
        for storage in kept.values():
            nbytes = storage.nbytes()
            self._host[at: at + nbytes].copy_(_bytes_view(storage, self.device), non_blocking=pin)
            at += nbytes

    def _copy_back(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Host copies into their device storages (``[nbytes]`` uint8 views), on the current stream."""
        for view, host in copies:
            view.copy_(host, non_blocking=self.device.type == "cuda")

    def wait(self, writes: bool = True) -> None:
        """The current stream waits for a background :meth:`onload`'s copies (no host sync; off CUDA: they run
        now). ``writes``: what comes next may change the storages, so a :meth:`copy_out` is dropped (the current
        stream first waits for its reads)."""
        if writes and self._early is not None:
            if self._early[1] is not None:
                torch.cuda.current_stream(self.device).wait_event(self._early[1])
            self._early = None
        self.start()
        copies, self._pending = self._pending, []  # off CUDA: they run now
        if copies:
            t0 = time.perf_counter()
            self._copy_back(copies)
            self._stall_s = time.perf_counter() - t0
        if self._copied is not None and not self._waited:
            stream = torch.cuda.current_stream(self.device)
            self._asked = torch.cuda.Event(enable_timing=True)
            self._asked.record(stream)
            stream.wait_event(self._copied)
            self._waited = True

    def stall_s(self) -> float | None:
        """Seconds the last awaited background :meth:`onload` held up its reader (CUDA: from when the current stream
        started waiting to when the copies ended, 0 when they ended first; off CUDA: the copies' own time), once;
        None when there is none to report, or its copies are still running (no host sync here)."""
        if self._stall_s is not None:
            stall, self._stall_s = self._stall_s, None
            return stall
        if self._asked is None or self._copied is None or not self._copied.query() or not self._asked.query():
            return None
        stall, self._asked = max(0.0, self._asked.elapsed_time(self._copied)) / 1000, None
        return stall


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (chained or not), or ``optimizer`` itself."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [inner for one in chained for inner in torch_optimizers(getattr(one, "optimizer", None))]


def trainer_optimizers(trainer) -> list[torch.optim.Optimizer]:
    """The torch optimizers of a trainer: its model's, and its value head's (a critic's) if it has one."""
    return torch_optimizers(trainer.optimizer) + torch_optimizers(getattr(trainer, "head_optimizer", None))


def state_parts(trainer) -> dict[str, list[torch.Tensor | None]]:
    """The state of a :class:`~posttrain.plugins.trainers.megatron.trainer.MegatronTrainer` by
    ``trainer.backend.offload_parts`` part:

    - ``weights``: the model's (and a critic's value head's) parameters and buffers, kept;
    - ``reference``: the snapshots kept on the device (the reference policy's weights), kept;
    - ``optimizer``: the optimizers' parameters (fp32 masters or their shards: the CPU path's AdamW steps its master
      copies) and state (Adam's moments, step counters), kept;
    - ``grads``: every gradient (``grad``, Megatron's ``main_grad`` views of its gradient buffers), dropped: each train
      step zeroes them before its first backward.

    A storage is one part's only: an optimizer's parameter that shares the model's storage (no master copies: fp32
    weights) is a weight, and moves only with ``weights``."""
    modules = [m for m in (trainer.model, trainer.value_head) if m is not None]
    # nn.Module's own buffers(): Megatron's DDP wrapper keeps its parameter and gradient buffers in an attribute of
    # that name, a list, which shadows the method
    weights = [t for m in modules for t in (*m.parameters(), *torch.nn.Module.buffers(m))]
    grads = [g for m in modules for p in m.parameters() for g in (p.grad, getattr(p, "main_grad", None))]
    optimizer: list[torch.Tensor] = []
    for opt in trainer_optimizers(trainer):
        for group in opt.param_groups:
            optimizer += group["params"]
            grads += [p.grad for p in group["params"]]
        optimizer += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    weight_storages = {t.untyped_storage().data_ptr() for t in weights}
    optimizer = [t for t in optimizer if t.untyped_storage().data_ptr() not in weight_storages]
    reference = [t for saved in trainer._snapshots.saved.values() for t in saved.values()]
    return {"weights": weights, "reference": reference, "optimizer": optimizer, "grads": grads}


class TrainerOffload:
    """A trainer's state in two :class:`HostOffload` s: the optimizer's (``optimizer``) and the rest. The rest moves
    when :meth:`offload` and :meth:`onload` are called. The optimizer's state, the most bytes with Adam and touched
    only by the optimizer step and a checkpoint, overlaps other work (``trainer.backend.offload_overlap``): it comes
    back on a side stream behind the log-prob and forward/backward passes (the first pass calls :meth:`start` once its
    inputs are on the device; :meth:`ready` puts the current stream after the copies), and leaves for host memory at
    the weight push (due from :meth:`after_step`, started by :meth:`start_out`), so the offload that follows only frees
    it."""

    def __init__(self, trainer, device: torch.device):
        self.trainer = trainer
        self.rest, self.optimizer = HostOffload(device), HostOffload(device)
        self._out_due = False  # the optimizer's state may leave with the next weight push

    def offload(self, parts: Iterable[str]) -> int:
        self._out_due = False  # no push came (or it started the copy): the offload copies what is left
        parts = set(parts)
        if "optimizer" in parts and not self.optimizer.has_host_buffer:
            # The loop offloads before the first step, when Adam has no moments yet: made now (zeros, as that step
            # would make them), the host buffer is pinned once at its full size, not again after the first step (at
            # Qwen3-1.7B on an H200 that second pinning held step 0 up by ~14 s)
            for opt in trainer_optimizers(self.trainer):
                if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
                    init_adam_state(opt)
        by_part = state_parts(self.trainer)
        later = by_part["optimizer"] if "optimizer" in parts else []
        kept_later = {t.untyped_storage().data_ptr() for t in later}
        keep = [t for part in ("weights", "reference") if part in parts for t in by_part[part]]
        drop = [g for g in by_part["grads"] if g is not None and g.untyped_storage().data_ptr() not in kept_later] \
            if "grads" in parts else []
        return self.rest.offload(keep, drop) + self.optimizer.offload(later)

    def onload(self, background: bool) -> int:
        return self.rest.onload() + self.optimizer.onload(background=background)

    def start(self) -> None:
        """A pass's inputs are on the device: the optimizer's state may start back behind them."""
        self.optimizer.start()

    def ready(self, writes: bool = True) -> None:
        """Before anything reads the optimizer's state (``writes``: or changes it): the current stream waits for
        its copies (and a change drops the copy out, due or started)."""
        if writes:  # (a load, say): no copy out ahead, the offload then copies what it finds
            self._out_due = False
        self.optimizer.wait(writes=writes)

    def after_step(self, parts: Iterable[str], overlap: bool) -> None:
        """At the end of a train step: with ``overlap``, and the optimizer's state offloaded before, that state is due
        for host memory with the weight push (:meth:`start_out`). Not at once: before the push the loop gives the
        trainer's cache back to the driver, and a ``cudaFree`` waits for the whole device, this copy included."""
        self._out_due = overlap and "optimizer" in parts and self.optimizer.has_host_buffer

    def start_out(self) -> None:
        """The weight push begins (``export_hf``): the optimizer's state, due since the step, starts for host memory
        behind it (:meth:`HostOffload.copy_out`; the offload after the push then only frees it)."""
        if self._out_due:
            self._out_due = False
            self.optimizer.copy_out(state_parts(self.trainer)["optimizer"])

    def stats(self) -> dict[str, float]:
        """``train/`` metrics, each once: ``offload_wait_s``, how long the last optimizer step waited for the
        optimizer's state (what the passes did not hide), after each background onload; ``offload_pin_s``, the
        seconds new host buffers took to make (the first offload's, mostly)."""
        out = {}
        stall = self.optimizer.stall_s()
        if stall is not None:
            out["offload_wait_s"] = stall
        made = [h.pin_s for h in (self.rest, self.optimizer) if h.pin_s is not None]
        if made:
            out["offload_pin_s"] = sum(made)
            self.rest.pin_s = self.optimizer.pin_s = None
        return out
