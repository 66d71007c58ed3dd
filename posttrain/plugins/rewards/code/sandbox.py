"""Running untrusted, model-written Python with limits (the ``code`` reward's executor).

Layers, each independent of the others:

1. **OS limits** (``setrlimit`` in the child before ``exec``): address space (``memory_mb``), CPU seconds,
   file size, open files, no core dumps; its own session and process group.
2. **Namespaces** when the ``unshare`` tool may create them (root, or unprivileged user namespaces):
   a private network namespace (no interface but a down loopback: nothing is reachable) and a private
   PID namespace whose init is killed with the sandbox, so every process it started dies with it,
   including ones that ``setsid()`` or double-fork away from the process group.
3. **A Python guard** (an audit hook installed before the program runs; audit hooks cannot be removed
   from Python): no sockets, no ``fork``/``exec``/``subprocess``/``os.system`` (unless
   ``allow_subprocess``), no ``ctypes`` (which could call libc around the guard), and no file writes,
   deletes, renames or directory changes outside the working directory.
4. **Cleanup**: a wall-clock ``timeout``; on timeout or exit the whole process group and every
   descendant still alive is killed; the temporary working directory is removed.

Without namespaces (``isolation()["namespaces"] is False``) layer 2 is missing: network access and
escaped processes are then stopped only by the Python guard and by the kill of descendants.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

GUARD = r'''
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_ALLOW_SUB = {allow_subprocess}
_BLOCK_ALWAYS = {{"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
                 "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "mmap.__new__",
                 "sys.remote_exec", "os.setuid", "sys.setrecursionlimit.disabled"}}
_BLOCK_SUB = {{"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
              "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn"}}
_BLOCK_IMPORTS = {{"ctypes", "_ctypes", "cffi"}} | (set() if _ALLOW_SUB else {{"multiprocessing", "_posixsubprocess"}})
_PATH_EVENTS = {{"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                "os.symlink", "os.link", "shutil.rmtree", "shutil.move", "os.chdir", "os.chroot"}}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _inside(path):
    try:
        p = os.fsdecode(path) if not isinstance(path, int) else None
    except Exception:
        return False
    if p is None:
        return True
    real = os.path.realpath(p)
    return real == _ROOT or real.startswith(_ROOT + os.sep) or real == os.devnull

def _guard(event, args):
    if event in _BLOCK_ALWAYS or (not _ALLOW_SUB and event in _BLOCK_SUB):
        raise PermissionError(f"sandbox: {{event}} is not allowed")
    if event == "import" and args and str(args[0]).split(".")[0] in _BLOCK_IMPORTS:
        raise ImportError(f"sandbox: import of {{args[0]}} is not allowed")
    if event == "open" and len(args) >= 3:
        path, mode, flags = args[0], args[1], args[2]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {{path!r}} outside the working directory is not allowed")
    elif event in _PATH_EVENTS:
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {{event}} on {{a!r}} outside the working directory is not allowed")
    elif event == "os.rename" or event == "os.replace":
        if not all(_inside(a) for a in args[:2]):
            raise PermissionError(f"sandbox: {{event}} outside the working directory is not allowed")

sys.addaudithook(_guard)
del _guard
__file__ = {main!r}
sys.argv = [__file__]
_code = compile(open(__file__).read(), __file__, "exec")
exec(_code, {{"__name__": "__main__", "__file__": __file__, "__builtins__": __builtins__}})
'''


@dataclass
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout: float = 10.0  # wall clock, seconds
    cpu_seconds: int = 10
    memory_mb: int = 1024  # address space; Python itself needs ~50 MB
    file_size_mb: int = 16
    open_files: int = 64
    allow_subprocess: bool = False
    python_guard: bool = True  # tests turn it off to check the OS layers alone


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    extra: dict[str, str] = field(default_factory=dict)  # files the program left, read back on request

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.lru_cache(maxsize=1)
def namespace_prefix() -> tuple[str, ...]:
    """The ``unshare`` command line that gives a private network and PID namespace here, or ``()``."""
    tool = shutil.which("unshare")
    if tool is None:
        return ()
    for extra in ((), ("--map-root-user",)):
        cmd = (tool, *extra, "--net", "--pid", "--fork", "--kill-child")
        try:
            if subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0:
                return cmd
        except (OSError, subprocess.SubprocessError):
            continue
    return ()


def isolation() -> dict[str, bool]:
    """Which layers are available on this machine."""
    return {"namespaces": bool(namespace_prefix()), "rlimits": True, "python_guard": True}


def _limit_child(limits: SandboxLimits):
    """The ``preexec_fn`` setting the rlimits. Everything is computed here, in the parent: the child
    between fork and exec may not import or allocate safely when the parent has threads."""
    mem = limits.memory_mb * 2**20
    pairs = [(resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, limits.cpu_seconds),
             (resource.RLIMIT_FSIZE, limits.file_size_mb * 2**20),
             (resource.RLIMIT_NOFILE, limits.open_files), (resource.RLIMIT_CORE, 0)]
    setrlimit = resource.setrlimit

    def apply() -> None:
        for what, value in pairs:
            setrlimit(what, (value, value))
    return apply


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process group and every descendant still alive (escapees from the group too)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in descendants:
        try:
            p.kill()
        except psutil.Error:
            pass


def run_python(source: str, stdin: str = "", limits: SandboxLimits | None = None,
               files: dict[str, str] | None = None, read_back: tuple[str, ...] = ()) -> SandboxResult:
    """Run ``source`` as ``__main__`` in a fresh temporary directory under the sandbox's limits.

    :param files: extra files written into the working directory first (``name -> text``).
    :param read_back: names of files to read from the working directory after the run (``extra``).
    """
    limits = limits or SandboxLimits()
    workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    start = time.perf_counter()
    proc = None
    try:
        main = os.path.join(workdir, "main.py")
        Path(main).write_text(source, encoding="utf-8")
        for name, text in (files or {}).items():
            Path(workdir, name).write_text(text, encoding="utf-8")
        if limits.python_guard:
            boot = GUARD.format(allow_subprocess=limits.allow_subprocess, main=main)
            argv = [sys.executable, "-I", "-c", boot]
        else:
            argv = [sys.executable, "-I", main]
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([*namespace_prefix(), *argv], cwd=workdir, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=_limit_child(limits))
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode("utf-8"), timeout=limits.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc)
            out, err = proc.communicate()
        extra = {}
        for name in read_back:
            p = Path(workdir, name)
            if p.is_file():
                extra[name] = p.read_text(encoding="utf-8", errors="replace")
        return SandboxResult(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                             timed_out, time.perf_counter() - start, extra)
    finally:
        if proc is not None:
            _kill_tree(proc)  # children left running after a normal exit die too
            if proc.poll() is None:
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)

