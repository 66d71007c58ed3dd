"""The file system under a run: a checkpoint reaches the disk before anything names it, a failed one gives
its space back and leaves `latest` where it was, and a disk's failure reads as one line."""

from __future__ import annotations

import collections
import errno
import os
from pathlib import Path

import pytest

from posttrain.core import storage
from posttrain.core.errors import RunFailed
from posttrain.core.run_dir import RunDirectory


def write_trainer(files: dict[str, bytes]):
    def save(d: str) -> None:
        os.makedirs(d)
        for name, data in files.items():
            Path(d, name).write_bytes(data)
    return save


def test_a_checkpoint_is_synced_before_it_is_renamed_and_before_latest_names_it(tmp_path, monkeypatch):
    run = RunDirectory(tmp_path)
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    final = run.save_checkpoint(4, write_trainer({"a.bin": b"1" * 10, "b.bin": b"2"}), {}, keep=2)
    renamed = [i for i, (kind, p) in enumerate(events) if kind == "replace"]
    synced_before = [p for kind, p in events[:renamed[0]] if kind == "fsync"]
    tmp = str(run.checkpoints / ".tmp-step_000004")
    for name in ("trainer/a.bin", "trainer/b.bin", "state.json", "trainer", ""):
        assert os.path.normpath(os.path.join(tmp, name)) in synced_before, (name, events)
    assert events[renamed[0]] == ("replace", str(final))
    assert events[renamed[0] + 1] == ("fsync", str(run.checkpoints))  # the rename itself is on the disk
    assert events[renamed[-1]] == ("replace", str(run.checkpoints / "latest"))
    assert ("fsync", str(run.checkpoints)) == events[-1]
    assert run.latest_checkpoint() == final and (final / "trainer" / "a.bin").read_bytes() == b"1" * 10


def test_a_checkpoint_that_fails_to_write_gives_its_space_back_and_latest_stays(tmp_path):
    run = RunDirectory(tmp_path)
    first = run.save_checkpoint(2, write_trainer({"w.bin": b"x"}), {}, keep=3)

    def full_disk(d: str) -> None:
        write_trainer({"w.bin": b"y" * 1000})(d)
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(d, "w2.bin"))

    with pytest.raises(RunFailed) as caught:
        run.save_checkpoint(4, full_disk, {}, keep=3)
    assert not (run.checkpoints / ".tmp-step_000004").exists()
    assert run.latest_checkpoint() == first and (first / "trainer" / "w.bin").read_bytes() == b"x"
    line = str(caught.value)
    assert line.startswith("storage: no space left on the device at " + str(run.checkpoints))
    assert "GiB free there" in line and "checkpoint.keep" in line


def test_a_short_write_is_a_full_disk_only_where_the_disk_is_nearly_full(tmp_path, monkeypatch):
    exc = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert storage.storage_failure(exc) is None  # where it wrote is unknown
    assert storage.storage_failure(exc, str(tmp_path / "ckpt")) is None  # this disk has room
    full = collections.namedtuple("usage", "total used free")(10 * 2**30, 10 * 2**30 - 4096, 4096)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: full)
    line = storage.storage_failure(exc, str(tmp_path / "ckpt"))
    assert line.startswith(f"storage: no space left on the device at {tmp_path / 'ckpt'} (0.00 GiB free there)")


@pytest.mark.parametrize("exc, what", [
    (RuntimeError("trainer rank 1: OSError: [Errno 28] No space left on device: '/runs/x/checkpoints/w'"),
     "no space left on the device at /runs/x/checkpoints/w"),
    (OSError(errno.EROFS, "Read-only file system", "/runs/y/metrics.jsonl"),
     "read-only file system at /runs/y/metrics.jsonl"),
    (OSError(errno.EDQUOT, "Disk quota exceeded", "/home/u/runs"), "disk quota exceeded at /home/u/runs"),
])
def test_disk_failures_read_as_one_line_naming_what_and_where(exc, what):
    line = storage.storage_failure(exc)
    assert line is not None and line.startswith("storage: " + what) and "\n" not in line
    assert line.endswith("rl-cli run --resume RUN_DIR continues from the last complete checkpoint")


@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: an illegal memory access"), ValueError("bad"),
                                 OSError(errno.ENOENT, "No such file or directory"), OSError(errno.EINVAL, "x", "/a")])
def test_other_failures_are_not_called_disk_failures(exc):
    assert storage.storage_failure(exc) is None


def test_a_wrapped_error_names_the_path_being_written_not_the_code_that_raised():
    """Megatron's checkpoint writer wraps an ENOSPC in text that quotes its own source line first."""
    from posttrain.core.storage import storage_failure

    exc = RuntimeError("in file /venv/site-packages/megatron/core/dist_checkpointing/strategies/torch.py:799: "
                       "OSError: [Errno 28] No space left on device")
    line = storage_failure(exc, "/runs/r/checkpoints/step_000002")
    quoted = storage_failure(RuntimeError("'/venv/megatron/core/x.py' raised: No space left on device"), "/runs/r")
    assert quoted.startswith("storage: no space left on the device at /runs/r"), quoted
    assert line.startswith("storage: no space left on the device at /runs/r/checkpoints"), line
