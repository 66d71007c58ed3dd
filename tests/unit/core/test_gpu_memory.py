"""``core.gpu_memory``: the devices' used memory sampled through each phase of a step (``perf/gpu_peak_gib_<phase>``).

NVML cannot run on these machines (no driver): the binding is checked against a stand-in library that answers
through the same ``ctypes`` calls (handles by index or UUID, ``nvmlMemory_t`` filled in), and the sampler
against a reader whose values the test moves. On a GPU the colocated run logs the real figures
(the colocated GRPO run's memory by phase, bench/RESULTS.md)."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from posttrain.core import gpu_memory
from posttrain.core.gpu_memory import GIB, MemoryWatch, nvml_reader, visible_devices
from posttrain.core.metrics import PhaseTimer


@pytest.mark.parametrize("env,count,expected", [
    (None, 3, [0, 1, 2]),
    ("", 3, []),
    ("1,0", 2, [1, 0]),
    ("0,7,1", 2, [0]),  # CUDA stops at the first entry that names no device
    ("GPU-5a1b,1", 2, ["GPU-5a1b", 1]),
    (" 1 , 0 ", 2, [1, 0]),
    ("MIG-0c2e", 1, None),
])
def test_visible_devices_reads_cuda_visible_devices_as_cuda_does(env, count, expected):
    assert visible_devices(env, count) == expected


class FakeNvml:
    """NVML's entry points as ``ctypes`` calls them: out-parameters come as ``byref`` objects."""

    def __init__(self, used: dict, count: int = 2, fail_init: bool = False):
        self.used, self.count, self.fail_init = used, count, fail_init
        self.by_uuid = {"GPU-aaaa": 1}

    def nvmlInit_v2(self):
        return 1 if self.fail_init else 0

    def nvmlDeviceGetCount_v2(self, ref):
        ref._obj.value = self.count
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, ref):
        if index.value >= self.count:
            return 2
        ref._obj.value = 100 + index.value
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid, ref):
        if uuid.decode() not in self.by_uuid:
            return 13
        ref._obj.value = 100 + self.by_uuid[uuid.decode()]
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, ref):
        device = handle.value - 100
        if device not in self.used:
            return 999
        ref._obj.used, ref._obj.total = self.used[device], 141 * GIB
        ref._obj.free = ref._obj.total - ref._obj.used
        return 0


def test_nvml_reader_reads_each_visible_gpu(monkeypatch):
    lib = FakeNvml({0: 3 * GIB, 1: 70 * GIB})
    monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    read = nvml_reader()
    assert read() == [3 * GIB, 70 * GIB]
    lib.used[1] = 80 * GIB  # read again: the device's figure now
    assert read() == [3 * GIB, 80 * GIB]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    assert nvml_reader()() == [80 * GIB]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert nvml_reader()() == [80 * GIB, 3 * GIB]


def test_nvml_reader_is_none_where_nvml_cannot_answer(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert nvml_reader() is None and gpu_memory.watch() is None  # the CPU machines: nothing logged
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeNvml({0: 1}, fail_init=True))
    assert nvml_reader() is None
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeNvml({}, count=1))  # no memory figure
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml_reader() is None
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeNvml({0: 1}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-unknown")
    assert nvml_reader() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0c2e")
    assert nvml_reader() is None


class MovingReader:
    """Used bytes per GPU that the test sets; counts the calls, so a test can wait for the sampler."""

    def __init__(self, used: list[int]):
        self.used, self.calls, self.fail = used, 0, False

    def __call__(self) -> list[int]:
        if self.fail:
            raise RuntimeError("the driver stopped answering")
        self.calls += 1
        return list(self.used)

    def wait_samples(self, n: int, timeout: float = 5.0) -> None:
        target = self.calls + n
        deadline = time.monotonic() + timeout
        while self.calls < target:
            assert time.monotonic() < deadline, "the sampler stopped sampling"
            time.sleep(0.001)


@pytest.fixture
def watching():
    """``watching(reader, interval_s)``: a MemoryWatch over ``reader``, closed when the test ends."""
    made = []

    def make(reader, interval_s):
        made.append(MemoryWatch(reader, interval_s=interval_s))
        return made[-1]

    yield make
    for watch in made:
        watch.close()


def test_a_window_keeps_a_spike_that_came_and_went_inside_it(watching):
    reader = MovingReader([10 * GIB, 2 * GIB])
    watch = watching(reader, 0.001)
    with watch.window() as w:
        reader.used = [10 * GIB, 60 * GIB]  # another process allocates ...
        reader.wait_samples(3)
        reader.used = [10 * GIB, 5 * GIB]  # ... and lets go before the phase ends
        reader.wait_samples(2)
    assert w.peak == 60 * GIB  # the largest over the GPUs, at its highest
    with watch.window() as later:
        reader.wait_samples(2)
    assert later.peak == 10 * GIB  # a new window starts from what the devices hold now
    watch.close()
    assert not watch._thread.is_alive()


def test_windows_nest_and_a_short_window_still_counts_its_ends(watching):
    reader = MovingReader([1 * GIB])
    watch = watching(reader, 3600)  # the thread samples once per window: the ends count
    with watch.window() as outer:
        reader.used = [4 * GIB]
        with watch.window() as inner:
            reader.used = [7 * GIB]
        reader.used = [2 * GIB]
    assert (inner.peak, outer.peak) == (7 * GIB, 7 * GIB)


def test_a_failing_reader_ends_the_sampling_not_the_run(watching):
    reader = MovingReader([3 * GIB])
    watch = watching(reader, 0.001)
    with watch.window() as w:
        reader.wait_samples(2)
        reader.fail = True
        time.sleep(0.02)
    assert w.peak == 3 * GIB  # what it saw before the failure
    with watch.window() as after:
        pass
    assert after.peak == 0


def test_an_idle_watch_does_not_sample(watching):
    reader = MovingReader([1 * GIB])
    watch = watching(reader, 0.001)
    with watch.window():
        reader.wait_samples(2)
    deadline = time.monotonic() + 5.0
    while watch._active.is_set():  # the thread finishes the sample it had started, then idles
        assert time.monotonic() < deadline, "the sampler kept sampling with no window open"
        time.sleep(0.001)
    calls = reader.calls
    time.sleep(0.05)
    assert reader.calls == calls
    assert any(t.name == "gpu-memory-watch" for t in threading.enumerate())


def test_phase_timer_logs_each_phase_peak_in_gib(watching):
    reader = MovingReader([8 * GIB])
    timer = PhaseTimer(memory=watching(reader, 3600))
    with timer("generate"):
        reader.used = [40 * GIB]
    reader.used = [20 * GIB]
    with timer("train"):
        pass
    with timer("generate"):  # a phase met twice in a step: the higher peak
        reader.used = [30 * GIB]
    out = timer.pop()
    assert out["perf/gpu_peak_gib_generate"] == 40.0
    assert out["perf/gpu_peak_gib_train"] == 20.0
    assert set(out) == {"perf/time_generate", "perf/time_train", "perf/gpu_peak_gib_generate",
                        "perf/gpu_peak_gib_train"}
    assert timer.pop() == {}  # popped: the next step starts empty


def test_phase_timer_without_a_watch_logs_times_only():
    timer = PhaseTimer()
    with timer("sync"):
        pass
    assert list(timer.pop()) == ["perf/time_sync"]
