"""The server processes rollout starts: free ports, HTTP readiness, clean stops, and ``ManagedServer``
(readiness, restart of a dead server)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def spawn(command: list[str], log_path=None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a server process in its own session (so it can be stopped with its children), told by
    the kernel to die with the process that started it: a driver killed with SIGKILL leaves no engine
    or router behind holding ports and memory."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    parent = os.getpid()
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {}), PARENT_ENV: str(parent)},
                            preexec_fn=lambda: _die_with_parent(parent))


PARENT_ENV = "POSTTRAIN_PARENT_PID"


def exit_with_parent(poll_s: float = 0.5) -> None:
    """In a process that :func:`spawn` started (engine servers, trainer ranks): a daemon thread that ends
    it once the process that started it is gone. Defence in depth for ``PR_SET_PDEATHSIG``, which the
    kernel ties to the *thread* that forked (a server restarted from a worker thread) and which a
    reparenting to a subreaper does not trigger; this depends on neither. A no-op without the variable.
    Also: SIGUSR1 writes every thread's stack to this process's output (its log), so a run's stall report
    (``core.watchdog``) can ask a stuck server or rank where it is."""
    parent = int(os.environ.pop(PARENT_ENV, "0") or 0)
    if parent > 1:
        _stacks_on_sigusr1()
        watch_parent(parent, poll_s)


def _stacks_on_sigusr1() -> None:
    import faulthandler

    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (OSError, ValueError, AttributeError, RuntimeError):  # no stderr descriptor, or not on this platform
        pass


def watch_parent(parent: int, poll_s: float = 0.5) -> None:
    """A daemon thread that ends this process once ``parent`` is no longer its parent (it died: the
    process was reparented). Module-level, so a spawned helper can run it as its initializer."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _libc_prctl():
    """libc's ``prctl``, resolved in the parent (None off Linux). Loading a library in the forked child
    would run the dynamic loader there, whose lock another thread of a multithreaded parent may hold at
    the fork: the child would wait forever before its exec, and so would ``Popen``."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: PR_SET_PDEATHSIG = SIGKILL (Linux; a no-op elsewhere). A parent that died
    between the fork and this call sends no signal any more, so the child checks and exits itself."""
    if _PRCTL is None:
        return
    _PRCTL(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


_forking_pid = 0  # the process that forked, recorded by the before-fork hook; a child reads its copy
_fork_hooks = False


def forks_die_with_parent() -> None:
    """Every later ``fork`` of this process (a library's multiprocessing workers: Megatron's checkpoint
    writers fork one per bucket) gets ``PR_SET_PDEATHSIG = SIGKILL``, as :func:`spawn`'s children do: a
    driver killed in the middle of a checkpoint save leaves no writer behind, blocked forever on a queue
    whose other end died. Idempotent; a no-op off Linux."""
    global _fork_hooks
    if _fork_hooks or _PRCTL is None:
        return
    _fork_hooks = True

    def before() -> None:
        global _forking_pid
        _forking_pid = os.getpid()

    os.register_at_fork(before=before, after_in_child=lambda: _die_with_parent(_forking_pid))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (bind to 0 and read it back)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(url: str) -> bool:
    """True when nothing listens on ``url``'s host and port (a server may bind it)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: past TIME_WAIT
        try:
            s.bind((parts.hostname, parts.port))
            return True
        except OSError:
            return False


def http_ok(url: str, timeout: float = 5.0) -> bool:
    """True when GET ``url`` answers 2xx within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen | None = None, interval_s: float = 0.1) -> None:
    """Poll ``url`` until it answers 2xx; raise ``TimeoutError`` (or ``RuntimeError`` if ``proc`` exits). Every
    ``interval_s``: a poll of a server not yet listening is a refused connection (about a millisecond), and each
    engine or router start waits half an interval on average after it is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before {url} answered")
        if http_ok(url, timeout=5.0):  # a server up but busy may take seconds to answer
            return
        time.sleep(interval_s)
    raise TimeoutError(f"{url} did not answer 2xx within {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """SIGTERM the process group started for ``proc``, then SIGKILL after ``grace_s``."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait(grace_s)


def where_logged(log_path: str | Path | None, limit: int = 300) -> str:
    """``; its log: PATH: LINE`` for a server that failed, LINE the last non-blank line of its log (what it said as
    it died: an error, an exception's message), at most ``limit`` characters; empty without a log."""
    if log_path is None:
        return ""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 8192))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return f"; its log: {log_path}" + (f": {lines[-1][:limit]}" if lines else "")


class ManagedServer:
    """A server process with readiness (``health_path``, SGLang's ``/health_generate`` by default) and
    restart-on-failure: what every engine backend that starts servers gets from the fleet."""

    def __init__(self, command: list[str], base_url: str, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 600.0, max_failures: int = 3,
                 health_timeout_s: float = 30.0, health_path: str = "/health_generate"):
        self.command, self.base_url = list(command), base_url.rstrip("/")
        self.health_url = self.base_url + health_path
        self.log_path, self.env = log_path, env
        self.ready_timeout_s, self.max_failures, self.health_timeout_s = ready_timeout_s, max_failures, health_timeout_s
        self.proc: subprocess.Popen | None = None
        self.failures = 0
        self.restarts = 0

    def start(self, wait: bool = True) -> ManagedServer:
        self.proc = spawn(self.command, self.log_path, self.env)
        self.failures = 0
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Block until the health path answers 200; raise if the process exits or time runs out."""
        try:
            wait_http_ok(self.health_url, self.ready_timeout_s, self.proc)
        except Exception:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        """One health check; counts consecutive failures."""
        ok = self.alive() and http_ok(self.health_url, timeout=self.health_timeout_s)
        self.failures = 0 if ok else self.failures + 1
        return ok

    def ensure_running(self) -> bool:
        """Restart the server if its process died or it failed ``max_failures`` checks in a row.

        :returns: True when a restart happened (the caller re-syncs weights and re-registers it).
        """
        if self.alive() and (self.healthy() or self.failures < self.max_failures):
            return False
        self.stop()
        self.restarts += 1
        self.start(wait=True)
        return True

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def __enter__(self) -> ManagedServer:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
