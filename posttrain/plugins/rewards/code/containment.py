"""Holding every process of one sandbox run, and ending them all when the run ends, whatever they did.

Two mechanisms, each used where this machine offers it (:func:`probe` says which):

- **the namespace's init, by pidfd**: the sandbox runs its program as pid 1 of a fresh PID namespace
  (``bwrap --as-pid-1``). bwrap reports that process's host pid on ``--info-fd``; a pidfd opened on it
  (checked against the namespace bwrap reports) cannot be confused with a later process of the same
  number. SIGKILL to it ends the namespace: the kernel kills every process in it, detached and
  re-parented ones too, before the init's exit completes. Works for any uid on Linux >= 5.3.
- **a cgroup per run**: the chain joins a fresh cgroup before bwrap starts (``echo 0 > cgroup.procs``
  in a shell stage, so nothing forks outside it). On cgroup v2 ``cgroup.kill`` ends everything in it at
  once; with a memory controller (v2 ``memory.max``, or v1 ``memory.limit_in_bytes``) the run's resident
  memory is bounded as a whole: anonymous memory, tmpfs and memfd pages and the kernel's inodes alike,
  which an address-space rlimit does not count. Needs a cgroup directory this process may write (root,
  or a delegated subtree); otherwise only the pidfd holds.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

_PREFIX = "posttrain-sandbox-"
CGROUPS = {"enabled": True}  # off once a made cgroup could not be joined here (the sandbox's probe finds out)


def _own_cgroups() -> dict[str, str]:
    """``{"": v2 path, "memory": v1 path, ...}`` from ``/proc/self/cgroup``."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _mounts() -> dict[str, tuple[str, str]]:
    """``{"": (mount point, root) of cgroup2, "memory": (...) of the v1 memory hierarchy}``."""
    out: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 5 or len(rparts) < 3:
            continue
        if rparts[0] == "cgroup2":
            out.setdefault("", (parts[4], parts[3]))
        elif rparts[0] == "cgroup" and "memory" in rparts[2].split(","):
            out.setdefault("memory", (parts[4], parts[3]))
    return out


def _cgroup_dir(kind: str) -> Path | None:
    """The writable directory of this process's cgroup in hierarchy ``kind`` ("" = v2), or None."""
    try:
        mount, root = _mounts()[kind]
        own = _own_cgroups()[kind]
    except (KeyError, OSError, ValueError):
        return None
    rel = os.path.relpath(own, root) if own.startswith(root) else None
    if rel is None:
        return None
    d = Path(mount) / ("" if rel == "." else rel)
    return d if d.is_dir() and os.access(d, os.W_OK) else None


@dataclass
class Cgroup:
    """The cgroups of one run: ``procs`` files the chain writes itself into, ``kill_file`` (v2) and the
    directories to remove afterwards."""

    procs: list[str] = field(default_factory=list)
    kill_file: str | None = None
    memory_limited: bool = False
    dirs: list[Path] = field(default_factory=list)

    @classmethod
    def create(cls, memory_bytes: int) -> "Cgroup":
        cg = cls()
        if not CGROUPS["enabled"]:
            return cg
        name = f"{_PREFIX}{os.getpid()}-{time.monotonic_ns()}"
        v2 = _cgroup_dir("")
        if v2 is not None and cg._make(v2 / name):
            cg.kill_file = str(v2 / name / "cgroup.kill") if (v2 / name / "cgroup.kill").exists() else None
            cg.memory_limited = cg._limit(v2 / name, {"memory.max": memory_bytes, "memory.swap.max": 0})
        if not cg.memory_limited:
            v1 = _cgroup_dir("memory")
            if v1 is not None and cg._make(v1 / name):
                cg.memory_limited = cg._limit(v1 / name, {"memory.limit_in_bytes": memory_bytes,
                                                          "memory.memsw.limit_in_bytes": memory_bytes})
        return cg

    def _make(self, d: Path) -> bool:
        try:
            d.mkdir()
        except OSError:
            return False
        self.dirs.append(d)
        self.procs.append(str(d / "cgroup.procs"))
        return True

    @staticmethod
    def _limit(d: Path, values: dict[str, int]) -> bool:
        """Write each limit that exists (the first must); True when the first took."""
        for i, (key, value) in enumerate(values.items()):
            try:
                (d / key).write_text(str(value))
            except OSError:
                if i == 0:
                    return False
        return True

    def kill(self) -> None:
        if self.kill_file:
            try:
                Path(self.kill_file).write_text("1")
            except OSError:
                pass

    def remove(self, within: float = 2.0) -> None:
        """Remove the directories once their processes are gone (they may take a moment to exit)."""
        deadline = time.monotonic() + within
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)


# The stage that puts the whole chain into the run's cgroups before anything forks: its arguments are the
# number of cgroup.procs files, the files, then the command.
JOIN_STAGE = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n - 1)); done; exec "$@"'


class NamespaceInit:
    """The sandbox's pid 1, held by a pidfd opened from bwrap's ``--info-fd`` report."""

    def __init__(self, info_fd: int, deadline: float):
        self.pidfd: int | None = None
        info = _read_info(info_fd, deadline)
        pid = info.get("child-pid")
        if not isinstance(pid, int) or pid <= 0:
            return
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError:  # already gone: its namespace went with it
            return
        ns = info.get("pid-namespace")
        try:
            same = ns is None or os.stat(f"/proc/{pid}/ns/pid").st_ino == ns
        except OSError:
            same = True  # not ours to read: the pidfd was opened while bwrap still waited on it
        if not same:  # the pid was taken by another process after ours ended
            self.close()

    def kill(self) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass

    def wait_gone(self, within: float) -> bool:
        """Whether the init (and so its whole namespace) has exited within ``within`` seconds."""
        if self.pidfd is None:
            return True
        sel = selectors.DefaultSelector()
        sel.register(self.pidfd, selectors.EVENT_READ)
        try:
            return bool(sel.select(within))
        finally:
            sel.close()

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _read_info(fd: int, deadline: float) -> dict:
    """bwrap's JSON report on ``fd`` (read to EOF: bwrap closes it after writing), {} if none came."""
    data = b""
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while (remaining := deadline - time.monotonic()) > 0 and sel.select(remaining):
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        sel.close()
    try:
        info = json.loads(data.decode() or "{}")
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


@functools.lru_cache(maxsize=1)
def probe() -> dict:
    """What a cgroup gives a run here: ``{"cgroup_kill": bool, "memory_cgroup": bool}``."""
    cg = Cgroup.create(64 * 2**20)
    try:
        return {"cgroup_kill": cg.kill_file is not None, "memory_cgroup": cg.memory_limited}
    finally:
        cg.remove()
