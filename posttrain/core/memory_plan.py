"""Memory plan: who holds the shared GPUs in each phase of a colocated run.

``resources.colocate`` puts the trainer and the engines on the same GPUs. The engines release their memory
after generating and take it back in three parts before the next generation: their weights, the update into
them, then their KV cache last, in the room the trainer left. With ``resources.offload_trainer`` the trainer's
state (weights, gradients, optimizer) waits in host memory while the engines generate, and is on the device
only while their KV cache is released: the trainer's turn in a step, the first push (and a resume's load),
each checkpoint, the final export. Without ``colocate`` every move here is a no-op.

Per step, with both on::

    generate | release engines, onload trainer | log-probs, train | trainer frees its buffers,
    engines take back weights, push | offload trainer | engines take back KV cache | generate ...
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

from posttrain.core.metrics import PhaseTimer


@dataclass(frozen=True)
class MemoryPlan:
    """The moves around each phase. ``on_trainer(fn, *args)`` runs a trainer call on the step's trainer thread."""

    colocate: bool
    offload: bool
    trainer: Any
    engines: Any
    on_trainer: Callable[..., Awaitable[Any]]

    @contextmanager
    def around_first_push(self) -> Iterator[None]:
        """A resume's load and the first push bring the trainer's state back beside the engines' weights (the
        engines' KV cache released); afterwards the state goes to host memory and the cache comes back."""
        if self.offload:
            self.engines.release_memory(["kv_cache"])
        yield
        if self.offload:
            self.trainer.offload()
            self.engines.resume_memory(["kv_cache"])

    @contextmanager
    def around_checkpoint(self) -> Iterator[None]:
        """The save brings the trainer's state back beside the engines' weights, not their KV cache."""
        if self.offload:
            self.engines.release_memory(["kv_cache"])
        yield
        if self.offload:
            self.engines.resume_memory(["kv_cache"])

    async def trainer_turn(self, timer: PhaseTimer) -> None:
        """Before the step's log-probs and training: the engines release everything; the trainer's state comes
        back from host memory."""
        if self.colocate:
            with timer("release"):
                await asyncio.to_thread(self.engines.release_memory)
            if self.offload:
                with timer("onload"):
                    await self.on_trainer(self.trainer.onload)

    async def engines_turn(self, timer: PhaseTimer, push: Callable[[], Awaitable[Any]]) -> tuple[Any, float | None]:
        """After training: room for the engines' weights and the update, ``push()`` (its result returned), the
        trainer's state to host memory (the GiB it moved, None without the offload), then the engines' KV cache."""
        offloaded_gib = None
        with timer("sync"):
            if self.colocate:
                await self.on_trainer(self.trainer.release_memory)
                await asyncio.to_thread(self.engines.resume_memory, ["weights"])
            pushed = await push()
        if self.offload:
            with timer("offload"):
                offloaded_gib = await self.on_trainer(self.trainer.offload)
        if self.colocate:
            with timer("sync"):  # the engines' KV cache last, in the room the trainer left
                await asyncio.to_thread(self.engines.resume_memory, ["kv_cache"])
        return pushed, offloaded_gib

    async def before_export(self) -> None:
        """The engines are done: their memory for the trainer's state, back for the final export."""
        if self.offload:
            await asyncio.to_thread(self.engines.release_memory)
