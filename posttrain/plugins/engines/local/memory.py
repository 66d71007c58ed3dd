"""Release and resume the local engine's GPU memory around a colocated trainer's turn (SGLang's
``/release_memory_occupation`` and ``/resume_memory_occupation`` with ``tags`` ``weights`` and ``kv_cache``).

- ``weights``: every parameter and buffer is copied into pinned host memory (allocated once, reused by
  later releases) and the module points at the host copy while released; ``resume`` copies it back.
  Weights are kept, not dropped: a later weight update need not cover every tensor.
- ``kv_cache``: the cache holds nothing once the engine is idle, so it is dropped and comes back zeroed
  (masked positions are multiplied by zero weights, and stale NaNs would survive that).

Two ways to hold them on the GPU:

- **stable** (:meth:`EngineMemory.make_stable`, the default with CUDA graphs where the driver allows it):
  weights and cache live in two ``vmm.StableBuffer``s, whose physical memory is given back on release
  while their virtual addresses stay reserved. Resume maps fresh memory at the same addresses, so the
  captured CUDA graphs (and the compiled decode inside them) stay valid: no recapture after a release.
- **plain** (otherwise): tensors are freed and re-allocated at new addresses, and the CUDA graphs that
  point at the old ones are dropped on either release.

On a CPU engine both tags are no-ops.
"""

from __future__ import annotations

from typing import Any

MEMORY_TAGS = ("weights", "kv_cache")
_ALIGN = 512  # byte alignment of each storage inside the weights buffer (any dtype's itemsize divides it)


def _view(base: Any, byte_offset: int, dtype: Any, shape: tuple[int, ...], stride: tuple[int, ...]):
    """A ``dtype`` tensor of ``shape``/``stride`` at ``byte_offset`` into ``base``'s storage (``[N]`` uint8)."""
    import torch

    return torch.empty(0, dtype=dtype, device=base.device).set_(
        base.untyped_storage(), byte_offset // dtype.itemsize, shape, stride)


class _StableWeights:
    """Every storage behind the model's parameters and buffers, packed into one stable buffer.

    ``slots``: ``(put, byte_offset, dtype, shape, stride)`` for every parameter/buffer, so that it can be
    pointed at the GPU buffer or at the same bytes of the host copy. Storages shared by several tensors
    (tied embeddings, views) are packed once and stay shared."""

    def __init__(self, slots: list, make_buffer: Any):
        import torch

        regions: dict[int, int] = {}  # storage data_ptr -> byte offset in the buffer
        sources: list[tuple[int, Any]] = []
        plan, size = [], 0
        for _key, get, put in slots:
            t = get()
            storage = t.untyped_storage()
            at = regions.get(storage.data_ptr())
            if at is None:
                at = regions[storage.data_ptr()] = size
                sources.append((at, storage))
                size += -(-storage.nbytes() // _ALIGN) * _ALIGN
            plan.append((put, at + t.storage_offset() * t.element_size(), t.dtype, tuple(t.shape), tuple(t.stride())))
        self.buffer = make_buffer(max(size, 1))
        base = self.buffer.tensor
        for at, storage in sources:
            src = torch.empty(0, dtype=torch.uint8, device=base.device).set_(storage)
            base[at:at + src.numel()].copy_(src)
        self.slots = plan
        self.host = None  # pinned copy of the whole buffer, allocated on the first release
        self.point_at(base)

    def point_at(self, base: Any) -> None:
        for put, at, dtype, shape, stride in self.slots:
            put(_view(base, at, dtype, shape, stride))


class EngineMemory:
    """What is released now (``released``: a set of tags), the host copies of the weights, and the
    stable buffers when :meth:`make_stable` placed weights and cache in them."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.released: set[str] = set()
        self._host: dict[Any, Any] = {}  # plain mode: slot key -> pinned host copy, reused by every release
        self._kv_shape: tuple[int, ...] | None = None
        self._v_shape: tuple[int, ...] | None = None  # MLA: the values are narrower than the keys (mla.py)
        self._weights: _StableWeights | None = None
        self._kv: Any = None  # stable mode: the buffer holding k_cache then v_cache

    @property
    def on_gpu(self) -> bool:
        return self.runner.device.type == "cuda"

    @property
    def stable(self) -> bool:
        return self._weights is not None

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

    def make_stable(self, make_buffer: Any = None) -> str | None:
        """Move weights and KV cache into stable buffers (``make_buffer(nbytes)`` -> a
        ``vmm.StableBuffer``; default: on the runner's GPU through the CUDA driver). Call before the
        first decode, with nothing released. Returns None, or why not (one line; memory then stays plain)."""
        r = self.runner
        if self.released or self.stable:
            return "memory already released or stable"
        if make_buffer is None:
            from posttrain.plugins.engines.local.vmm import CudaDriver, StableBuffer, vmm_supported

            if not self.on_gpu:
                return "stable memory needs a CUDA engine"
            index = r.device.index or 0
            why = vmm_supported(index)
            if why:
                return why
            driver = CudaDriver(index)
            make_buffer = lambda n: StableBuffer(n, driver)  # noqa: E731
        r.reset_graphs()
        self._weights = _StableWeights(list(self._slots()), make_buffer)
        self._kv_shape, self._v_shape = tuple(r.k_cache.shape), tuple(r.v_cache.shape)
        self._kv_dtype, size = r.k_cache.dtype, r.k_cache.nbytes + r.v_cache.nbytes
        r.k_cache = r.v_cache = None  # the plain cache is freed before the stable one is mapped
        self._empty_cache()
        self._kv = make_buffer(size)
        self._point_kv()
        return None

    def _point_kv(self) -> None:
        import torch

        r, base = self.runner, self._kv.tensor
        base.zero_()
        k, v = (torch.empty(s, device="meta", dtype=self._kv_dtype) for s in (self._kv_shape, self._v_shape))
        r.k_cache = _view(base, 0, self._kv_dtype, self._kv_shape, k.stride())
        r.v_cache = _view(base, k.nbytes, self._kv_dtype, self._v_shape, v.stride())  # MLA: values narrower (mla.py)

    def _sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize(self.runner.device)

    def _empty_cache(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.empty_cache()

    def release(self, tags: set[str]) -> None:
        if self.stable:
            return self._release_stable(tags)
        if not self.on_gpu:
            self.released |= set(tags)
            return
        import torch

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
            self._sync()
            self.released.add("weights")
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self._kv_shape = tuple(r.k_cache.shape)
            self._v_shape = tuple(r.v_cache.shape)  # MLA: the values are c of the keys' c + r numbers (mla.py)
            r.k_cache = r.v_cache = None
            self.released.add("kv_cache")
        self._empty_cache()

    def resume(self, tags: set[str]) -> None:
        if self.stable:
            return self._resume_stable(tags)
        if not self.on_gpu:
            self.released -= set(tags)
            return
        import torch

        r = self.runner
        r.reset_graphs()
        if "weights" in tags and "weights" in self.released:
            for _, get, put in list(self._slots()):
                put(get().to(r.device, non_blocking=True))  # the pinned copy stays in _host for next time
            self._sync()
            self.released.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.released:
            r.k_cache = torch.zeros(self._kv_shape, dtype=r.dtype, device=r.device)
            r.v_cache = torch.zeros(self._v_shape, dtype=r.dtype, device=r.device)
            self.released.discard("kv_cache")

    # -- stable mode: same addresses after resume, graphs kept ------------------------------------
    def _release_stable(self, tags: set[str]) -> None:
        import torch

        w = self._weights
        if "weights" in tags and "weights" not in self.released:
            if w.host is None:
                w.host = torch.empty(w.buffer.nbytes, dtype=torch.uint8, pin_memory=self.on_gpu)
            w.host.copy_(w.buffer.tensor, non_blocking=True)
            w.point_at(w.host)  # anything reading weights while released reads the host copy
            self._sync()
            w.buffer.unmap()
            self.released.add("weights")
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self.runner.k_cache = self.runner.v_cache = None
            self._sync()
            self._kv.unmap()
            self.released.add("kv_cache")
        self._empty_cache()  # PyTorch's cached free blocks too (the graphs' own pool stays with them)

    def _resume_stable(self, tags: set[str]) -> None:
        w = self._weights
        if "weights" in tags and "weights" in self.released:
            w.buffer.map()
            w.buffer.tensor.copy_(w.host, non_blocking=True)  # host memory stays pinned for the next release
            w.point_at(w.buffer.tensor)
            self._sync()
            self.released.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.released:
            self._kv.map()
            self._point_kv()
            self._sync()
            self.released.discard("kv_cache")

    def stats(self) -> dict[str, Any]:
        """GiB allocated now and at peak in this process (CUDA only; the stable buffers are not in
        PyTorch's counts, so they are listed apart), what is released, and whether memory is stable."""
        out: dict[str, Any] = {"released": sorted(self.released), "stable": self.stable}
        if self.on_gpu:
            import torch

            out.update(allocated_gib=torch.cuda.memory_allocated(self.runner.device) / 2**30,
                       peak_gib=torch.cuda.max_memory_allocated(self.runner.device) / 2**30,
                       reserved_gib=torch.cuda.memory_reserved(self.runner.device) / 2**30)
            if self.stable:
                mapped = [b.size for b in (self._weights.buffer, self._kv) if b.mapped]
                out["stable_mapped_gib"] = sum(mapped) / 2**30
        return out
