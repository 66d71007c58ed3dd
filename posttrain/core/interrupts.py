"""Ctrl-C and SIGTERM during training: the step in flight finishes, a checkpoint is saved at its boundary, and
the run stops with the command that resumes it; nothing trained is lost and no step is trained twice.

The CLI's signal handlers call :func:`request`. While the loop trains (inside :func:`graceful`), the first
signal is recorded and the loop stops after the step in flight (:func:`pending`); a second signal, or
``timeout_s`` without reaching the step's end, stops the run at once, as outside training (start-up, export),
where every signal stops it at once. Main thread only (signal handlers run there).
"""

from __future__ import annotations

import _thread
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_state: dict = {"listening": False, "pending": None, "timer": None, "timeout_s": 0.0}


def request(exc: BaseException, signum: int) -> bool:
    """A stop asked for by signal ``signum`` (raising ``exc`` stops the run): True when it is deferred to the
    end of the step in flight; False (the caller raises ``exc`` now) outside training or the second time."""
    if not _state["listening"] or _state["pending"] is not None:
        return False
    _state["pending"] = exc
    if _state["timeout_s"] > 0:  # the step may hang: then the same signal again, which stops at once
        timer = threading.Timer(_state["timeout_s"], _thread.interrupt_main, args=(signum,))
        timer.daemon = True
        timer.start()
        _state["timer"] = timer
    return True


def pending() -> BaseException | None:
    """The stop asked for during the step in flight, if any."""
    return _state["pending"]


@contextmanager
def graceful(timeout_s: float | None) -> Iterator[None]:
    """Within: a first Ctrl-C/SIGTERM waits for the step's end (at most ``timeout_s``; 0: no bound; None: it
    stops at once, as outside)."""
    _state.update(listening=timeout_s is not None, pending=None, timeout_s=float(timeout_s or 0.0))
    try:
        yield
    finally:
        if _state["timer"] is not None:
            _state["timer"].cancel()
        _state.update(listening=False, pending=None, timer=None)


def signal_name(exc: BaseException) -> str:
    from posttrain.core.errors import Terminated

    return signal.Signals.SIGTERM.name if isinstance(exc, Terminated) else "Ctrl-C"
