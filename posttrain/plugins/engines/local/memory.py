"""Release and resume the local engine's GPU memory around a colocated trainer's turn (SGLang's
``/release_memory_occupation`` and ``/resume_memory_occupation`` with ``tags`` ``weights`` and ``kv_cache``).

- ``weights``: every parameter and buffer is copied into a pinned host tensor (allocated once, reused by
  later releases) and the module points at it, so the GPU copy is freed; ``resume`` copies it back.
  Weights are kept, not dropped: a later weight update need not cover every tensor.
- ``kv_cache``: the cache holds nothing once the engine is idle, so it is dropped and re-allocated
  (zeroed: masked positions are multiplied by zero weights, and stale NaNs would survive that).

CUDA graphs point at the old storage and are discarded on either release. On a CPU engine both are no-ops.
"""

from __future__ import annotations

from typing import Any

MEMORY_TAGS = ("weights", "kv_cache")


class EngineMemory:
    """What is released now (``released``: a set of tags) and the pinned copies of the weights."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.released: set[str] = set()
        self._host: dict[Any, Any] = {}  # slot key -> pinned host copy, reused by every release
        self._kv_shape: tuple[int, ...] | None = None

    @property
    def on_gpu(self) -> bool:
        return self.runner.device.type == "cuda"

    def _slots(self):
        """``(key, get, set)`` for every parameter (tied ones once: ``p.data`` swaps keep them tied)
        and every buffer, ``key`` stable across releases."""
        seen: set[int] = set()
        for module in self.runner.model.modules():
            for p in module._parameters.values():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                yield id(p), (lambda p=p: p.data), (lambda t, p=p: setattr(p, "data", t))
            for name, b in module._buffers.items():
                if b is None:
                    continue
                yield (id(module), name), (lambda m=module, n=name: m._buffers[n]), \
                    (lambda t, m=module, n=name: m._buffers.__setitem__(n, t))

    def release(self, tags: set[str]) -> None:
        import torch

        if not self.on_gpu:
            self.released |= set(tags)
            return
        r = self.runner
        r.reset_graphs()
        if "weights" in tags and "weights" not in self.released:
            for key, get, put in list(self._slots()):
                t = get()
                host = self._host.get(key)
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    host = self._host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                put(host)
            torch.cuda.synchronize(r.device)
            self.released.add("weights")
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self._kv_shape = tuple(r.k_cache.shape)
            r.k_cache = r.v_cache = None
            self.released.add("kv_cache")
        torch.cuda.empty_cache()

    def resume(self, tags: set[str]) -> None:
        import torch

        if not self.on_gpu:
            self.released -= set(tags)
            return
        r = self.runner
        r.reset_graphs()
        if "weights" in tags and "weights" in self.released:
            for _, get, put in list(self._slots()):
                put(get().to(r.device, non_blocking=True))  # the pinned copy stays in _host for next time
            torch.cuda.synchronize(r.device)
            self.released.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.released:
            r.k_cache = torch.zeros(self._kv_shape, dtype=r.dtype, device=r.device)
            r.v_cache = torch.zeros(self._kv_shape, dtype=r.dtype, device=r.device)
            self.released.discard("kv_cache")

    def stats(self) -> dict[str, Any]:
        """GiB allocated now and at peak in this process (CUDA only), and what is released."""
        out: dict[str, Any] = {"released": sorted(self.released)}
        if self.on_gpu:
            import torch

            out.update(allocated_gib=torch.cuda.memory_allocated(self.runner.device) / 2**30,
                       peak_gib=torch.cuda.max_memory_allocated(self.runner.device) / 2**30,
                       reserved_gib=torch.cuda.memory_reserved(self.runner.device) / 2**30)
        return out
