"""The file system under a run: durable writes, and failures of the disk said in one line.

- :func:`fsync_tree` / :func:`fsync_dir`: a checkpoint's files reach the disk before the rename that
  publishes it and before ``latest`` names it, so an OS crash leaves ``latest`` on a complete checkpoint.
- :func:`storage_failure`: an exception caused by the file system (a full disk, a quota, a read-only
  mount, a directory the run may not write, one removed under it), found anywhere in its chain of causes
  or in the text of a wrapped error (PyTorch's ``PytorchStreamWriter failed writing file``), becomes one
  line: what happened, where, and what to do. The CLI prints it and exits 1 (no traceback without
  ``--debug``); trainer ranks send it to the driver the same way.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

_WHAT = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
         errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "not permitted",
         errno.ENOENT: "no such file or directory"}
_DO = {errno.ENOSPC: "free space there, keep fewer checkpoints (checkpoint.keep) or give --run-dir on another disk",
       errno.EDQUOT: "free space under your quota or give --run-dir on another disk",
       errno.EROFS: "give --run-dir on a writable file system",
       errno.EACCES: "make it writable for this user or give --run-dir elsewhere",
       errno.EPERM: "make it writable for this user or give --run-dir elsewhere",
       errno.ENOENT: "something removed it while the run wrote there: keep the run directory in place"}
# errors that wrap an OSError in text only (a trainer rank's message, a checkpoint writer's worker)
_TEXTS = [(re.compile(p, re.IGNORECASE), code) for p, code in (
    (r"no space left on device", errno.ENOSPC), (r"disk quota exceeded", errno.EDQUOT),
    (r"read-only file system", errno.EROFS))]
# PyTorch's stream writer after a short write: a full disk, when the disk being written is (nearly) full
_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+|file write failed|failed writing file", re.IGNORECASE)
_NEARLY_FULL_BYTES = 64 * 2**20
_SOURCE = re.compile(r"\.py(:\d+)*:?$")  # `/x/torch.py:799:` in a wrapped error's text: code, not the disk
_QUOTED_PATH = re.compile(r"'(/[^']+)'|\"(/[^\"]+)\"|(?:file|writing) (/\S+)")


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | Path) -> None:
    """fsync every file and directory under ``path`` (directories after their entries), then ``path``."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            full = os.path.join(root, name)
            if os.path.islink(full):
                continue
            fd = os.open(full, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def write_durably(path: str | Path, text: str) -> None:
    """``path`` holds ``text`` after a crash or before it, never a part: a synced temporary file renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _where(path: str | None) -> str:
    """``'/runs/x/ckpt' (1.2 GiB free on /runs)`` or the path alone where its file system cannot be read."""
    if not path:
        return ""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return f" {path}"
    return f" {path} ({free / 2**30:.2f} GiB free there)"


def storage_failure(exc: BaseException, writing: str | None = None) -> str | None:
    """One line for ``exc`` when the file system caused it, else None. ``writing``: the path being written,
    where the caller knows it (a short write there is a full disk when little space is left on it)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _WHAT and (e.errno != errno.ENOENT or e.filename):
            return _line(e.errno, os.fsdecode(e.filename) if e.filename is not None else None)
    for e in _chain(exc):
        text = str(e)
        for pattern, code in _TEXTS:
            if pattern.search(text):
                return _line(code, _path_in(text, writing))
    if writing and any(_SHORT_WRITE.search(str(e)) for e in _chain(exc)) and _nearly_full(writing):
        return _line(errno.ENOSPC, writing)
    return None


def _path_in(text: str, writing: str | None) -> str | None:
    """The path an error text names: the first quoted path that is not Python source (a wrapped error's
    text may quote the file of the code that raised it), else ``writing``."""
    for found in _QUOTED_PATH.finditer(text):
        path = next(g for g in found.groups() if g)
        if not _SOURCE.search(path):
            return path
    return writing


def _nearly_full(path: str) -> bool:
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


def _line(code: int, path: str | None) -> str:
    return (f"storage: {_WHAT[code]}{' at' if path else ''}{_where(path)}: {_DO[code]}; "
            "rl-cli run --resume RUN_DIR continues from the last complete checkpoint")
