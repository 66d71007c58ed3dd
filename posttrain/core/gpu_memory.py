"""GPU memory as the driver sees it, sampled through each phase of a step.

A colocated run hands its GPUs back and forth: the engines release their memory after generating, the trainer
trains, then gives its memory up while the engines take theirs back (weights, the update, the KV cache). The
allocators' own peaks (``perf/trainer_peak_gib``, ``perf/engine_peak_gib``) each see one process; a transition
that allocates before the other side has let go shows only in the device's total. So the loop samples the
device's used memory (NVML: every process on the GPU, trainer and engines together) while each phase runs,
and logs the highest value per phase, ``perf/gpu_peak_gib_<phase>`` (GiB, the largest over the GPUs this
process sees): a re-allocation spike is a phase whose peak passes the others'.

- :func:`nvml_reader`: a function giving the used bytes of each GPU this process can see (``CUDA_VISIBLE_DEVICES``
  by index or UUID), or None where NVML cannot answer (no driver: CPU machines; then nothing is logged).
- :class:`MemoryWatch`: a daemon thread that samples such a reader every ``interval_s`` while a window is open;
  ``with watch.window() as w: ...`` leaves the window's highest sample in ``w.peak`` (bytes). Both ends of a
  window are sampled as well, so a phase shorter than the interval still counts. Windows may nest.

NVML is read through ``ctypes`` (``libnvidia-ml.so.1`` ships with the driver), as ``vmm`` reads the CUDA driver:
no package to install, no CUDA context in the loop's process.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

GIB = 1024 ** 3


class _NvmlMemory(ctypes.Structure):  # nvmlMemory_t (v1): bytes
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def visible_devices(env: str | None, count: int) -> list[int | str] | None:
    """The GPUs a process with ``CUDA_VISIBLE_DEVICES=env`` sees, as NVML indices (ints) or UUIDs (``GPU-...``),
    in CUDA's reading: unset means all ``count``; the list stops at its first entry that names no device (CUDA
    ignores the rest). None for MIG instances, whose memory NVML reports apart."""
    if env is None:
        return list(range(count))
    out: list[int | str] = []
    for entry in (e.strip() for e in env.split(",")):
        if entry.startswith("MIG-"):
            return None
        if entry.startswith("GPU-"):
            out.append(entry)
        elif entry.isdigit() and int(entry) < count:
            out.append(int(entry))
        else:
            break
    return out


def nvml_reader() -> Callable[[], list[int]] | None:
    """``read() -> [used bytes per visible GPU]`` through NVML, or None where it cannot answer (no library, no
    GPU, an NVML error, MIG)."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        count = ctypes.c_uint()
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        devices = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), count.value)
        handles = []
        for dev in devices or ():
            handle = ctypes.c_void_p()
            rc = (lib.nvmlDeviceGetHandleByUUID(dev.encode(), ctypes.byref(handle)) if isinstance(dev, str)
                  else lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(dev), ctypes.byref(handle)))
            if rc != 0:
                return None
            handles.append(handle)
    except (OSError, AttributeError):  # no driver library here (CPU), or one without these entry points
        return None
    if not handles:
        return None

    def read() -> list[int]:
        used = []
        for handle in handles:
            info = _NvmlMemory()
            if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(info)) != 0:
                raise RuntimeError("nvmlDeviceGetMemoryInfo failed")
            used.append(int(info.used))
        return used

    try:
        read()
    except RuntimeError:
        return None
    return read


class Window:
    """One open window of a :class:`MemoryWatch`: ``peak``, the highest used bytes sampled in it (the largest
    over the GPUs)."""

    def __init__(self, peak: int):
        self.peak = peak


class MemoryWatch:
    """Samples ``reader`` (``() -> [used bytes per GPU]``) every ``interval_s`` on a daemon thread while a window
    is open (idle otherwise); :meth:`window` gives each window its highest sample. A reader that fails stops
    the sampling; the windows then keep what they saw. :meth:`close` ends the thread."""

    def __init__(self, reader: Callable[[], list[int]], interval_s: float = 0.01):
        self.reader, self.interval_s = reader, interval_s
        self._open: list[Window] = []
        self._lock = threading.Lock()
        self._active = threading.Event()  # set while a window is open
        self._stop = threading.Event()
        self._failed = False
        self._thread: threading.Thread | None = None

    def _sample(self) -> int | None:
        if self._failed:
            return None
        try:
            return max(self.reader(), default=0)
        except Exception:  # noqa: BLE001 - a driver that stops answering ends the sampling, not the run
            self._failed = True
            return None

    def _record(self, used: int | None) -> None:
        if used is None:
            return
        with self._lock:
            for w in self._open:
                w.peak = max(w.peak, used)

    def _run(self) -> None:
        while True:
            self._active.wait()
            if self._stop.is_set():
                return
            self._record(self._sample())
            with self._lock:  # a window opened after this check sets the event again
                if not self._open:
                    self._active.clear()
            if self._stop.wait(self.interval_s):
                return

    @contextmanager
    def window(self) -> Iterator[Window]:
        w = Window(self._sample() or 0)
        with self._lock:
            self._open.append(w)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="gpu-memory-watch", daemon=True)
                self._thread.start()
        self._active.set()
        try:
            yield w
        finally:
            self._record(self._sample())
            with self._lock:
                self._open.remove(w)

    def close(self) -> None:
        self._stop.set()
        self._active.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


def watch(interval_s: float = 0.01) -> MemoryWatch | None:
    """A :class:`MemoryWatch` over this process's GPUs (:func:`nvml_reader`), or None where NVML cannot answer."""
    reader = nvml_reader()
    return MemoryWatch(reader, interval_s) if reader is not None else None
