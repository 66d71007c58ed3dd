"""Weight snapshots of :class:`~posttrain.plugins.trainers.megatron.trainer.MegatronTrainer` (the reference
policy ``"ref"``, taken at start by a run that uses it: ``TrainerConfig.uses_reference``), swapped in for ``log_probs(..., weights=tag)`` without copying the
policy's weights anywhere.

Where a snapshot lives, ``trainer.backend.ref_offload``:

- ``never``: on the training device, next to the policy (one more copy of this rank's weights: 3.4 GB for
  Qwen3-1.7B in bf16 on one GPU). Swapping is free: each parameter's ``.data`` is pointed at the
  snapshot's tensor for the pass and back afterwards (no copy at all, in either direction).
- ``always``: in pinned host memory. A pass copies it to the device with ``non_blocking`` copies on a
  side stream (host -> device only, at PCIe/C2C bandwidth), points the parameters at the device copy, and
  frees it afterwards. The policy's weights are never copied out and back.
- ``auto`` (default): ``never`` on CPU and when the snapshot is at most ``RESIDENT_FRACTION`` of the
  device's memory (colocated engines keep the rest), else ``always``.

The earlier path copied the policy's weights to the host and back around every reference pass, with the
snapshot on the host too: two host round trips of the whole model per call.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from posttrain.core.errors import UsageError

RESIDENT_FRACTION = 0.1  # auto: keep a snapshot on the device when it needs at most this share of its memory


def resident(mode: str, params: dict[str, torch.Tensor], device: torch.device) -> bool:
    """Whether snapshots stay on ``device`` under ``ref_offload`` ``mode`` (module docstring)."""
    if mode != "auto":
        return mode == "never"
    if device.type != "cuda":
        return True
    size = sum(p.numel() * p.element_size() for p in params.values())
    return size <= RESIDENT_FRACTION * torch.cuda.get_device_properties(device).total_memory


class Snapshots:
    """Tagged copies of a model's parameters (``params()``: name -> tensor, this rank's shards)."""

    def __init__(self, params: Any, device: torch.device, mode: str = "auto"):
        self.params, self.device, self.mode = params, device, mode
        self.saved: dict[str, dict[str, torch.Tensor]] = {}
        self.on_device: bool | None = None  # decided at the first snapshot

    def take(self, tag: str) -> None:
        """Copy the current weights under ``tag`` (on the device, or pinned on the host)."""
        params = self.params()
        if self.on_device is None:
            self.on_device = resident(self.mode, params, self.device)
        pin = not self.on_device and self.device.type == "cuda"
        with torch.no_grad():
            if self.on_device:
                self.saved[tag] = {n: p.detach().clone() for n, p in params.items()}
            else:
                self.saved[tag] = {n: p.detach().to("cpu", copy=True).pin_memory() if pin
                                   else p.detach().to("cpu", copy=True) for n, p in params.items()}

    def tags(self) -> list[str]:
        return list(self.saved)

    def _on_device(self, tag: str) -> dict[str, torch.Tensor]:
        saved = self.saved[tag]
        if self.on_device or self.device.type != "cuda":
            return {n: t.to(self.device) for n, t in saved.items()}  # no copy when already there
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            out = {n: t.to(self.device, non_blocking=True) for n, t in saved.items()}
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for t in out.values():  # the side stream's tensors are used (then freed) on the current stream
            t.record_stream(torch.cuda.current_stream(self.device))
        return out

    @contextmanager
    def swapped_in(self, tag: str | None) -> Iterator[None]:
        """The model computes with snapshot ``tag`` inside (no-op for None); forward passes only."""
        if tag is None:
            yield
            return
        if tag == "ref" and tag not in self.saved:  # the trainer takes it only for a run that uses it
            raise UsageError("weights='ref': this trainer keeps no reference policy; trainer.kl_loss_coef, "
                             "kl_in_reward_coef and log_kl are all off (any of them keeps the initial weights)")
        if tag not in self.saved:
            raise UsageError(f"no weights snapshot {tag!r}; have: {', '.join(self.saved) or 'none'}")
        params, weights = self.params(), self._on_device(tag)
        current = {n: p.data for n, p in params.items()}  # aliases of the policy's storage, not copies
        try:
            for n, p in params.items():
                p.data = weights[n]
            yield
        finally:
            for n, p in params.items():
                p.data = current[n]
