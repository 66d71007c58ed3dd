"""Synchronous tools run in worker processes, so a tool stuck in C code (a huge ``**``, a regex that
backtracks forever) is killed at its timeout and never holds the driver's event loop.

A thread cannot do this: a thread cannot be killed, and C code that holds the GIL stalls every coroutine
of the driver until it returns, whatever ``asyncio.wait_for`` says. So each call goes to a **spawned**
process (spawned, not forked: the driver has threads) serving one call at a time over a pipe. The call's
clock starts once the worker is up; the event loop waits on the pipe with ``add_reader``. Past the
timeout the worker is SIGKILLed and dropped (the next call starts a fresh one), and the caller gets
:class:`ToolTimeout`. An exception in the tool comes back as :class:`ToolFailed` with its type and
message; a worker that dies (a segfault, the OOM killer) also gives :class:`ToolFailed`.

The callable travels by reference (pickle): module-level functions and instances of module-level classes
work; a ``--plugin`` file's module is loaded again in the worker from its path. Lambdas and local
functions cannot travel and give :class:`ToolFailed` naming the problem. Workers are not a security
boundary: tools are trusted code; only their inputs come from the model.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import importlib.util
import multiprocessing
import os
import pickle
import sys
from typing import Any


class ToolTimeout(Exception):
    """The tool did not answer within its timeout; its worker was killed."""


class ToolFailed(Exception):
    """The tool raised (``kind`` is the exception's type name), could not be sent, or its worker died."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


# ---- worker side --------------------------------------------------------------------------------------

def _load_module(name: str, path: str | None) -> None:
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
    except ImportError:
        if not path:
            raise
        spec = importlib.util.spec_from_file_location(name, path)  # a --plugin file: not importable by name
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def _serve(conn) -> None:
    """The worker's loop: (module, path, pickled callable, kwargs) in, ("ok", result) or ("err", ...) out."""
    conn.send(("ready",))
    while True:
        try:
            module, path, payload, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            _load_module(module, path)
            result = pickle.loads(payload)(**kwargs)
            pickle.dumps(result)  # fail here, as an answer, rather than inside send
            conn.send(("ok", result))
        except BaseException as exc:  # everything goes back as text; the worker keeps serving
            conn.send(("err", type(exc).__name__, str(exc)[:2000]))


# ---- driver side --------------------------------------------------------------------------------------

class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True, name="posttrain-tool-worker")
        self.process.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(1.0)  # SIGKILL is immediate; this only reaps
        self.conn.close()


async def _readable(conn, timeout: float) -> bool:
    """Wait, without blocking the loop, until ``conn`` has data (or EOF); False on timeout."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(True))
    try:
        return await asyncio.wait_for(fut, timeout)
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


class ToolWorkers:
    """A small pool of tool worker processes (at most ``max_workers`` busy at once)."""

    def __init__(self, max_workers: int = 4, start_timeout: float = 120.0):
        if max_workers < 1:
            raise ValueError(f"ToolWorkers.max_workers: expected >= 1, got {max_workers!r}")
        self.max_workers = max_workers
        self.start_timeout = start_timeout
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: list[_Worker] = []
        self._busy = 0

    async def _acquire(self) -> _Worker:
        while not self._idle and self._busy >= self.max_workers:
            await asyncio.sleep(0.01)  # loop-agnostic: the pool outlives any one event loop
        self._busy += 1
        if self._idle:
            return self._idle.pop()
        worker = None
        try:
            worker = _Worker(self._ctx)
            try:
                started = await _readable(worker.conn, self.start_timeout) and worker.conn.recv() == ("ready",)
            except (EOFError, OSError):
                started = False
            if not started:
                raise ToolFailed("WorkerStart", f"a tool worker did not start within {self.start_timeout:g} s")
        except BaseException:
            self._busy -= 1
            if worker is not None:
                worker.kill()
            raise
        return worker

    async def call(self, fn: Any, kwargs: dict, timeout_s: float) -> Any:
        """``fn(**kwargs)`` in a worker; raises :class:`ToolTimeout` or :class:`ToolFailed`."""
        mod_name = getattr(fn, "__module__", None) or type(fn).__module__
        path = getattr(sys.modules.get(mod_name), "__file__", None)
        try:
            payload = pickle.dumps(fn)
            pickle.dumps(kwargs)
        except Exception as exc:
            raise ToolFailed("NotPortable", f"cannot be sent to a tool worker process (define it at module "
                                            f"level): {type(exc).__name__}: {exc}") from None
        worker = await self._acquire()
        keep = False
        try:
            worker.conn.send((mod_name, path, payload, kwargs))
            if not await _readable(worker.conn, timeout_s):
                raise ToolTimeout(f"timed out after {timeout_s:g} s")
            try:
                reply = worker.conn.recv()
            except (EOFError, OSError):
                worker.process.join(1.0)
                raise ToolFailed("WorkerDied", f"the tool's worker process died (exit code "
                                               f"{worker.process.exitcode})") from None
            keep = True
            if reply[0] == "ok":
                return reply[1]
            raise ToolFailed(reply[1], reply[2])
        finally:
            self._busy -= 1
            if keep:
                self._idle.append(worker)
            else:  # timed out, died, or cancelled mid-call: its state is unknown
                worker.kill()

    def close(self) -> None:
        for worker in self._idle:
            worker.kill()
        self._idle.clear()


_DEFAULT: dict[int, ToolWorkers] = {}  # by pid: a forked child must not share its parent's workers


def default_workers() -> ToolWorkers:
    """The process-wide pool ``run_tool`` uses (``max_workers`` = min(4, CPUs))."""
    pool = _DEFAULT.get(os.getpid())
    if pool is None:
        pool = _DEFAULT[os.getpid()] = ToolWorkers(max_workers=min(4, os.cpu_count() or 1))
        atexit.register(pool.close)
    return pool
