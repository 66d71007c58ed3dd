"""Page-locked host memory of an exact size (trainers/megatron/host_memory.py): pageable bytes faulted in by
threads, then registered. Off CUDA the CUDA runtime's register calls are recorded, not made; the GPU test makes them."""

import mmap

import pytest
import torch

from posttrain.plugins.trainers.megatron.host_memory import advise_huge_pages, pinned_empty, touch_pages


def _recorders():
    calls = []
    register = lambda ptr, n: calls.append(("register", ptr, n)) or 0  # noqa: E731
    unregister = lambda ptr: calls.append(("unregister", ptr)) or 0  # noqa: E731
    return calls, register, unregister


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_every_byte_is_written_whatever_the_threads(threads):
    buffer = torch.full(((5 << 20) + 12345,), 7, dtype=torch.uint8)  # not a multiple of the 2 MiB chunks
    touch_pages(buffer, threads)
    assert int(buffer.count_nonzero()) == 0


def test_the_exact_size_is_registered_once_and_unregistered_once():
    calls, register, unregister = _recorders()
    nbytes = (3 << 20) + 1  # no rounding up to a power of two
    host, release, took = pinned_empty(nbytes, threads=2, register=register, unregister=unregister)
    assert host.dtype == torch.uint8 and host.numel() == nbytes and int(host.count_nonzero()) == 0
    assert calls == [("register", host.data_ptr(), nbytes)]
    assert took["touch_s"] >= 0 and took["register_s"] >= 0 and isinstance(took["huge_pages"], bool)
    release()
    release()  # idempotent: the second call does nothing
    assert calls[1:] == [("unregister", host.data_ptr())]


def test_a_dropped_buffer_is_unregistered_when_collected():
    calls, register, unregister = _recorders()
    host, _, _ = pinned_empty(1 << 20, threads=1, register=register, unregister=unregister)
    ptr = host.data_ptr()
    del host
    assert calls == [("register", ptr, 1 << 20), ("unregister", ptr)]


def test_nothing_to_pin_registers_nothing():
    calls, register, unregister = _recorders()
    host, release, _ = pinned_empty(0, register=register, unregister=unregister)
    release()
    assert host.numel() == 0 and calls == []


def test_buffers_share_no_page():
    """Each buffer is its own page-aligned mapping: registering one never overlaps another's pages."""
    calls, register, unregister = _recorders()
    buffers = [pinned_empty(n, threads=1, register=register, unregister=unregister)[0] for n in (100, 5000, 100)]
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers)
    assert all(start % mmap.PAGESIZE == 0 for start, _ in spans)
    assert all(-(-end // mmap.PAGESIZE) <= start // mmap.PAGESIZE for (_, end), (start, _) in zip(spans, spans[1:]))


def test_the_buffer_is_private_memory_that_may_take_huge_pages():
    """A shared anonymous map (Python's ``mmap`` default) is shmem: no transparent huge pages, 5x slower to fault in
    (bench/RESULTS.md). The buffer's mapping must be private."""
    _, register, unregister = _recorders()
    host, _, _ = pinned_empty(4 << 20, threads=1, register=register, unregister=unregister)
    ptr = host.data_ptr()
    with open("/proc/self/maps") as maps:
        spans = [line.split() for line in maps]
    perms = [p for span, p, *_ in spans if int(span.split("-")[0], 16) <= ptr < int(span.split("-")[1], 16)]
    assert perms and perms[0].startswith("rw") and perms[0][3] == "p", perms


def test_a_failed_registration_says_so():
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 0\.0 GiB failed with CUDA error 2"):
        pinned_empty(4096, threads=1, register=lambda ptr, n: 2, unregister=lambda ptr: 0)


def test_huge_pages_are_asked_only_over_whole_aligned_pages():
    assert advise_huge_pages(4096, 4096) is False  # no 2 MiB-aligned page inside: nothing asked
    buffer = torch.empty(6 << 20, dtype=torch.uint8)
    assert isinstance(advise_huge_pages(buffer.data_ptr(), buffer.numel()), bool)  # the kernel decides


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_registered_memory_is_pinned_and_copies_asynchronously_both_ways():
    host, release, _ = pinned_empty((64 << 20) + 3)
    assert host.is_pinned()
    source = torch.randint(0, 255, (host.numel(),), dtype=torch.uint8, device="cuda")
    host.copy_(source, non_blocking=True)
    back = torch.empty_like(source)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, source)
    release()
    assert not host.is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_failed_registration_leaves_no_error_for_the_next_kernel():
    """A second registration of the same pages fails; the runtime's error must not surface at the next launch."""
    from posttrain.plugins.trainers.megatron.host_memory import _cuda_register

    host, release, _ = pinned_empty(1 << 20)
    assert _cuda_register(host.data_ptr(), host.numel()) != 0  # already registered
    assert float((torch.ones(4, device="cuda") * 2).sum()) == 8.0
    release()
