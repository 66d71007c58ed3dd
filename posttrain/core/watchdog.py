"""The run watchdog: says who waits on whom when a run stops making progress.

Two parts. A process-wide registry of what the driver waits on right now: every wait on another process (an engine
request, a reward call, a trainer rank's answer, a weight push, a tool call, a collective) is entered as::

    with waiting_on("trainer_rank", "train: ranks [0, 1] of 2 have not answered") as wait:
        ...                         # wait.update(what) when the detail changes (ranks still pending)
    with waiting_on("engine", "POST http://127.0.0.1:30000/generate", blocking=False):
        await ...                   # a coroutine's wait: its thread's event loop runs on meanwhile

and a progress clock, ticked by each completed wait, each start-up phase and each step. A :class:`Watchdog` thread
checks the clock once a second; when nothing progressed for ``watchdog.stall_s`` seconds it writes
``RUN_DIR/stall-report.txt``:

- the active waits with their age: those that block their thread first, then coroutines' waits, each part oldest
  first. The first is the one the run is stuck on: a blocked thread holds up everything on it (a sync reward that
  blocks the event loop leaves every coroutine's wait on it unfinished too);
- every driver thread's Python stack (``sys._current_frames``);
- each probe's section (``Watchdog.add_probe``): the loop adds the trainer ranks' and engines' processes (pid,
  state -- ``stopped`` for a SIGSTOPped one --, and a SIGUSR1 sent to each, whose faulthandler writes its stacks to
  the named log) and each engine's queue depth (``/get_server_info``, 2 s timeout: an engine that does not answer is
  named so).

then one line on stderr. ``on_stall: exit`` ends the run with :class:`~posttrain.core.errors.Stalled` raised in the
main thread (a SIGUSR2 whose handler raises it: a blocking call there is interrupted, and as a ``KeyboardInterrupt``
no ``except Exception`` on the way swallows it), which the CLI reports as a ``RunFailed`` line, exit code 1; should the shut-down
itself hang on the stuck process past ``exit_grace_s``, the process exits with code 1 at once (its children die
with it). ``on_stall: wait`` keeps waiting and writes the report again every ``report_every_s`` while the stall lasts.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from posttrain.core.errors import Stalled
from posttrain.core.schema import option

KINDS = ("engine", "reward", "tool", "weight_push", "trainer_rank", "collective")


@dataclass
class WatchdogConfig:
    """When a run counts as stalled and what then happens (the run config's ``watchdog:`` section)."""

    stall_s: float = option(1800.0, ge=0.0, help="no progress (a finished engine/reward/trainer call, a step) for "
                                                 "this many seconds is a stall: RUN_DIR/stall-report.txt says who "
                                                 "waits on whom; 0 turns the watchdog off")
    startup_stall_s: float | None = option(None, gt=0.0, help="the bound on start-up instead (building the model, "
                                                              "loading the engines, the first push: single phases "
                                                              "that may take longer than a step); null: stall_s")
    on_stall: Literal["exit", "wait"] = option("exit", help="exit: the run ends with exit code 1 (resume it with "
                                                            "--resume); wait: it keeps waiting and reports again")
    report_every_s: float = option(600.0, gt=0.0, help="on_stall: wait: seconds between reports while the "
                                                       "stall lasts")
    exit_grace_s: float = option(60.0, gt=0.0, help="on_stall: exit: seconds the run may take to shut down "
                                                    "before the process exits at once (a hung process can hang "
                                                    "the shut-down too)")


class Wait:
    """One wait in progress: ``kind`` (one of :data:`KINDS`), ``what`` (URL, reward name, ranks), since when
    (``time.monotonic()``) and on which thread."""

    __slots__ = ("key", "kind", "what", "since", "thread", "blocking")

    def __init__(self, key: int, kind: str, what: str, blocking: bool = True):
        self.key, self.kind, self.what, self.blocking = key, kind, what, blocking
        self.since, self.thread = time.monotonic(), threading.current_thread().name

    def update(self, what: str) -> None:
        self.what = what

    def describe(self, now: float) -> str:
        where = "blocks thread" if self.blocking else "a coroutine on thread"
        return f"{self.kind} {self.what} ({now - self.since:.0f} s, {where} {self.thread})"


class Waits:
    """The registry of active waits and the progress clock (thread-safe; ``tick`` is one assignment)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[int, Wait] = {}
        self._keys = itertools.count()
        self.last_progress = time.monotonic()

    def tick(self) -> None:
        self.last_progress = time.monotonic()

    def enter(self, kind: str, what: str, blocking: bool = True) -> Wait:
        if kind not in KINDS:
            raise ValueError(f"wait kind {kind!r}: not one of {', '.join(KINDS)}")
        wait = Wait(next(self._keys), kind, what, blocking)
        with self._lock:
            self._active[wait.key] = wait
        return wait

    def leave(self, wait: Wait) -> None:
        with self._lock:
            self._active.pop(wait.key, None)
        self.tick()

    def active(self) -> list[Wait]:
        """The waits in progress: those that block their thread, then coroutines' waits; each oldest first."""
        with self._lock:
            return sorted(self._active.values(), key=lambda w: (not w.blocking, w.since))


WAITS = Waits()  # the driver's; trainer ranks and engines are other processes


@contextmanager
def waiting_on(kind: str, what: str, waits: Waits | None = None, blocking: bool = True) -> Iterator[Wait]:
    """Register a wait on another process for its duration; its end (answer or error) is progress. ``blocking``:
    the thread waits (a sync call); False for a coroutine's ``await`` (its event loop runs on)."""
    registry = waits or WAITS
    wait = registry.enter(kind, what, blocking)
    try:
        yield wait
    finally:
        registry.leave(wait)


def tick() -> None:
    """Progress: a step, a start-up phase."""
    WAITS.tick()


def driver_stacks() -> str:
    """Every thread of this process: its name and Python stack, most recent call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


class Watchdog:
    """The checking thread (see the module doc). ``report_path``: where reports go; ``resume_hint``: the end of
    the exit line. ``add_probe(title, fn)``: ``fn()`` returns lines for the report (a failing probe says so)."""

    def __init__(self, config: WatchdogConfig, report_path: str | Path, resume_hint: str = "",
                 waits: Waits | None = None, out: Any = None):
        self.config, self.report_path, self.resume_hint = config, Path(report_path), resume_hint
        self.waits, self.out = waits or WAITS, out
        self.probes: list[tuple[str, Callable[[], list[str]]]] = []
        self.probe_timeout_s = 15.0
        self.reports = 0
        self.fired: str | None = None  # the exit line, once the run was told to stop
        self._last_report: float | None = None
        self._reported_clock: float | None = None  # the progress clock the last report was about
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread().ident
        self._armed = False  # the main thread's SIGUSR2 handler raises the stall
        self._training = False  # start-up is over: stall_s applies, not startup_stall_s

    @property
    def enabled(self) -> bool:
        return self.config.stall_s > 0

    def add_probe(self, title: str, fn: Callable[[], list[str]]) -> None:
        self.probes.append((title, fn))

    def training(self) -> None:
        """Start-up is over: from now on ``stall_s`` bounds the time without progress."""
        self._training = True
        self.waits.tick()

    @property
    def limit_s(self) -> float:
        """The seconds without progress that make a stall now."""
        startup = self.config.startup_stall_s
        return self.config.stall_s if self._training or startup is None else startup

    def start(self) -> Watchdog:
        if not self.enabled:
            return self
        self.waits.tick()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, self._raise_stall)
            self._armed = True
        self._thread = threading.Thread(target=self._run, name="posttrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """The run is over: no more checks. A stall already signalled keeps its grace timer."""
        self._stop.set()
        if self._armed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # a signal still in flight must not kill the process

    def _run(self) -> None:
        every = min(1.0, self.config.stall_s / 5, self.limit_s / 5)
        while not self._stop.wait(every):
            if self.check() and self.config.on_stall == "exit":
                self._end_run()
                return

    def check(self, now: float | None = None) -> bool:
        """One look at the clock: True when a report was written now."""
        now = time.monotonic() if now is None else now
        idle = now - self.waits.last_progress
        if idle < self.limit_s:
            return False
        same_stall = self._reported_clock == self.waits.last_progress  # else progress came between: a new stall
        if same_stall and self._last_report is not None and now - self._last_report < self.config.report_every_s:
            return False
        self._last_report, self._reported_clock = now, self.waits.last_progress
        self.write_report(idle, now)
        return True

    def write_report(self, idle: float, now: float) -> str:
        """The report, written to ``report_path``; the one line that names it (also printed for ``wait``)."""
        waits = self.waits.active()
        oldest = waits[0].describe(now) if waits else "nothing registered (see the stacks)"
        key = "stall_s" if self._training or self.config.startup_stall_s is None else "startup_stall_s (start-up)"
        lines = [f"stalled: no progress for {idle:.0f} s (watchdog.{key} = {self.limit_s:g})", "",
                 "== waiting on (blocking waits, then coroutines'; oldest first) =="]
        lines += [f"  {w.describe(now)}" for w in waits] or ["  (no registered wait)"]
        for title, probe in self.probes:
            lines += ["", f"== {title} =="] + [f"  {line}" for line in _bounded(probe, self.probe_timeout_s)]
        lines += ["", "== driver threads (most recent call last) ==", driver_stacks()]
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        self.report_path.write_text("\n".join(lines) + "\n")
        self.reports += 1
        line = f"stalled: no progress for {idle:.0f} s, waiting on {oldest}; report: {self.report_path}"
        if self.config.on_stall == "wait":
            print(line + " (watchdog.on_stall: wait: still waiting)", file=self.out or sys.stderr, flush=True)
        self.fired = line + (f"; {self.resume_hint}" if self.resume_hint else "")
        return line

    def _end_run(self) -> None:
        """The stall ends the run in the main thread; a shut-down that hangs too ends the process. Started off the
        main thread (an embedding program's), the process is not ours to end: the line is printed, no more."""
        if not self._armed:
            print(f"error: {self.fired} (the watchdog runs off the main thread: it cannot stop the run)",
                  file=self.out or sys.stderr, flush=True)
            return
        signal.pthread_kill(self._main, signal.SIGUSR2)
        time.sleep(self.config.exit_grace_s)  # a daemon thread: a process that exits in time ends it
        print(f"error: {self.fired} (exiting now: the shut-down did not finish in {self.config.exit_grace_s:g} s)",
              file=self.out or sys.stderr, flush=True)
        os._exit(1)

    def _raise_stall(self, signum: int, frame: Any) -> None:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # once
        raise Stalled(self.fired or "stalled")


def _bounded(probe: Callable[[], list[str]], timeout_s: float) -> list[str]:
    """``probe()``'s lines, run on a thread of its own: a probe that fails or hangs (it may ask the stuck process
    itself) says so instead of keeping the report from coming out."""
    out: list[list[str]] = []

    def run() -> None:
        try:
            out.append(list(probe()))
        except Exception as exc:
            out.append([f"(probe failed: {type(exc).__name__}: {exc})"])

    thread = threading.Thread(target=run, name="posttrain-watchdog-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return out[0] if out else [f"(probe did not finish in {timeout_s:g} s)"]


def process_lines(processes: list[tuple[str, int, str | None]]) -> list[str]:
    """``label pid N: state`` for each process, and a SIGUSR1 sent to it: its faulthandler writes every thread's
    stack to its log (a stopped process writes it once continued)."""
    import psutil

    lines = []
    for label, pid, log in processes:
        try:
            state, where = psutil.Process(pid).status(), ""
            if _catches(pid, signal.SIGUSR1):  # uncaught, SIGUSR1 would end it
                os.kill(pid, signal.SIGUSR1)
                where = f"; stacks (SIGUSR1) go to {log}" if log else ""
        except (psutil.Error, OSError) as exc:
            state, where = f"gone ({type(exc).__name__})", ""
        lines.append(f"{label} pid {pid}: {state}{where}")
    return lines


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: ``SigCgt`` of ``/proc/PID/status``)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def engine_queue_lines(urls: list[str], api_key: str | None = None, timeout_s: float = 2.0) -> list[str]:
    """Each engine's queue from ``/get_server_info`` (``internal_states[0]``'s request counts), or that it did not
    answer within ``timeout_s``."""
    import json
    import urllib.request

    lines = []
    for url in urls:
        request = urllib.request.Request(url + "/get_server_info",
                                         headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # an HTTP error is an OSError
                info = json.loads(resp.read())
        except (OSError, ValueError) as exc:
            lines.append(f"engine {url}: did not answer /get_server_info in {timeout_s:g} s ({exc})")
            continue
        state = (info.get("internal_states") or [{}])[0]
        counts = {k: v for k, v in state.items() if isinstance(v, (int, float)) and "req" in k}
        lines.append(f"engine {url}: {counts or 'no request counts reported'}")
    return lines


def watch_roles(watchdog: Watchdog, trainer: Any, engines: Any) -> None:
    """The report's sections on the run's other processes: each trainer rank and engine server started here
    (state, stacks through SIGUSR1) and each engine's queue."""
    def processes() -> list[str]:
        # only roles whose class lists its processes: a Ray actor's handle would ask (and name pids of) another node
        listed = [p for role in (trainer, engines) if getattr(type(role), "processes", None) for p in role.processes()]
        return process_lines(listed) or ["(none started by this process)"]

    def queues() -> list[str]:
        return engine_queue_lines(engines.urls()[1], engines.api_key())

    watchdog.add_probe("trainer ranks and engine servers", processes)
    watchdog.add_probe("engine queues (/get_server_info)", queues)
