"""GPU memory whose addresses survive a release, through CUDA's virtual memory management (VMM).

A :class:`StableBuffer` reserves a virtual address range once and maps physical memory into it.
:meth:`StableBuffer.unmap` hands the physical memory back to the device (a colocated trainer can use it)
while the range stays reserved; :meth:`StableBuffer.map` backs the same addresses with fresh memory. A
CUDA graph captured over tensors in such a buffer stays valid across the pair, so the engine keeps its
graphs (and its compiled decode) through a colocated release/resume instead of recapturing them every
step. SGLang gets the same effect from torch_memory_saver, which hooks ``cudaMalloc`` through
``LD_PRELOAD``; here only the engine's weights and KV cache live in such buffers, and the driver API is
called through ``ctypes`` (nothing to build). Unmapped memory must not be touched: a kernel reading it
faults and takes the CUDA context down, so callers point every tensor elsewhere first
(``memory.EngineMemory``).

The driver calls go through :class:`CudaDriver`; tests on machines without CUDA pass a stand-in that
keeps the same contract (``tests/unit/plugins/engines/local/test_memory.py``).
"""

from __future__ import annotations

import ctypes
from typing import Any

# enum values of cuda.h (CUDA 11.2+; unchanged through 13)
_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_PROT_READWRITE = 3
_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class VmmError(RuntimeError):
    """A CUDA driver call of the VMM API failed (its name and the driver's error name in the message)."""


class CudaDriver:
    """The few driver calls a :class:`StableBuffer` needs, on device ordinal ``device`` (as CUDA numbers
    the visible devices, which is torch's index). Raises :class:`VmmError` when ``libcuda`` is missing."""

    def __init__(self, device: int = 0):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise VmmError(f"libcuda.so.1 not loadable: {e}") from None
        self.device = int(device)
        self._check("cuInit", self.lib.cuInit(0))
        self._bind()

    def _bind(self) -> None:
        """Make the device's primary context (the one PyTorch's runtime uses) current in this thread,
        where no CUDA call has made it so yet."""
        ctx = ctypes.c_void_p()
        self._check("cuCtxGetCurrent", self.lib.cuCtxGetCurrent(ctypes.byref(ctx)))
        if not ctx.value:
            dev = ctypes.c_int()
            self._check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), self.device))
            self._check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
            self._check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(ctx))

    def _check(self, call: str, code: int) -> None:
        if code:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(name))
            raise VmmError(f"{call} failed: {(name.value or b'?').decode()} ({code})")

    def _prop(self) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type, prop.location.type, prop.location.id = _ALLOCATION_TYPE_PINNED, _LOCATION_TYPE_DEVICE, self.device
        return prop

    def granularity(self) -> int:
        size = ctypes.c_size_t()
        prop = self._prop()
        self._check("cuMemGetAllocationGranularity",
                    self.lib.cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(prop), _GRANULARITY_RECOMMENDED))
        return size.value

    def reserve(self, size: int) -> int:
        self._bind()
        ptr = ctypes.c_uint64()
        self._check("cuMemAddressReserve", self.lib.cuMemAddressReserve(
            ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)))
        return ptr.value

    def create(self, size: int) -> int:
        self._bind()
        handle = ctypes.c_uint64()
        prop = self._prop()
        self._check("cuMemCreate", self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size),
                                                        ctypes.byref(prop), ctypes.c_uint64(0)))
        return handle.value

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._check("cuMemMap", self.lib.cuMemMap(ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                                  ctypes.c_uint64(handle), ctypes.c_uint64(0)))
        access = _AccessDesc()
        access.location.type, access.location.id, access.flags = _LOCATION_TYPE_DEVICE, self.device, _ACCESS_PROT_READWRITE
        self._check("cuMemSetAccess", self.lib.cuMemSetAccess(ctypes.c_uint64(ptr), ctypes.c_size_t(size),
                                                              ctypes.byref(access), ctypes.c_size_t(1)))

    def unmap(self, ptr: int, size: int) -> None:
        self._check("cuMemUnmap", self.lib.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size)))

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_uint64(handle)))

    def free_address(self, ptr: int, size: int) -> None:
        self._check("cuMemAddressFree", self.lib.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(size)))


class _CudaArray:
    """``__cuda_array_interface__`` of ``nbytes`` bytes at ``ptr``: what ``torch.as_tensor`` wraps."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class StableBuffer:
    """``nbytes`` of device memory at a virtual address that never changes (rounded up to the driver's
    granularity, 2 MiB on an H200). Mapped on creation.

    ``tensor``: the whole buffer as a ``uint8`` CUDA tensor (``[nbytes]``); views of it (through
    ``Tensor.set_`` on its storage) are what callers hand out. Valid only while :attr:`mapped`.
    """

    def __init__(self, nbytes: int, driver: Any, tensor_of: Any = None):
        self.driver = driver
        self.nbytes = int(nbytes)
        g = driver.granularity()
        self.size = max(g, -(-self.nbytes // g) * g)
        self.ptr = driver.reserve(self.size)
        self._handle: int | None = None
        self.map()
        self.tensor = (tensor_of or _torch_tensor_at)(self.ptr, self.nbytes, driver.device)

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Back the reserved range with fresh physical memory (its contents are undefined)."""
        if self._handle is None:
            handle = self.driver.create(self.size)
            try:
                self.driver.map(self.ptr, self.size, handle)
            except Exception:
                self.driver.release(handle)
                raise
            self._handle = handle

    def unmap(self) -> None:
        """Give the physical memory back; the addresses stay reserved for :meth:`map`."""
        if self._handle is not None:
            self.driver.unmap(self.ptr, self.size)
            self.driver.release(self._handle)
            self._handle = None

    def close(self) -> None:
        """Unmap and give the address range back (after this the buffer is unusable)."""
        self.unmap()
        self.driver.free_address(self.ptr, self.size)


def _torch_tensor_at(ptr: int, nbytes: int, device: int):
    import torch

    return torch.as_tensor(_CudaArray(ptr, nbytes), device=f"cuda:{device}")


def vmm_supported(device: int = 0) -> str | None:
    """None when this process can reserve, map, unmap and map again on ``device``; else why not (one
    line). Probes with one granule, so a sandbox without the VMM calls is found before the engine
    relies on them."""
    try:
        buf = StableBuffer(1, CudaDriver(device))
        buf.unmap()
        buf.map()
        buf.close()
    except (VmmError, OSError, RuntimeError, AttributeError) as e:
        return str(e).splitlines()[0]
    return None
