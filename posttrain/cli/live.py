"""What ``rl-cli run`` shows while training.

- Start-up phases as they happen (the loop calls :meth:`LiveDisplay.phase`): one line each, with the
  seconds since the run started, so a slow start says what it is waiting for.
- Per step: on a terminal a live table that fits 80 columns (phase timings join it on wider ones);
  elsewhere (a file, a pipe, Slurm, nohup) one plain, unwrapped line per step.
- ETA from the steady steps: the first step also compiles, allocates and warms caches, so counting it
  (or worse, the start-up) made the first estimates several times too long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

COLUMNS = [("reward", "rollout/reward_mean", "{:.3f}"), ("kl", "train/kl", "{:.4f}"),
           ("entropy", "train/entropy", "{:.3f}"), ("len", "rollout/response_len_mean", "{:.1f}"),
           ("tok/s", "perf/rollout_tokens_per_s", "{:.0f}"), ("step s", "perf/step_time", "{:.2f}")]
PHASES = ("generate", "log_probs", "train", "sync")
# what the loop's on_phase(name) means to a user; unknown names are shown as they are
STARTUP = {"model": "building the model (trainer)", "init_checkpoint": "writing its weights for the engines",
           "model_files": "writing the model's config and tokenizer for the engines",
           "offload": "moving the trainer's state to host memory", "engines": "starting the engines and the router",
           "connect": "joining the trainer and the engines (weight updates)", "data": "loading the prompts",
           "resume": "loading the checkpoint", "plan": "memory plan", "weights": "first weight push", "train": "training"}
ROWS_SHOWN = 15
ETA_WINDOW = 20  # steady steps averaged: recent enough to follow a slowdown, long enough to be smooth


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class LiveDisplay:
    """``on_phase`` and ``on_step`` callbacks of :func:`posttrain.core.loop.train`, rendered.

    :param first_step: the 0-based step training starts at (after a resume, the step after the checkpoint).
    :param clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, total_steps: int, console: Console, first_step: int = 0,
                 clock: Callable[[], float] = time.perf_counter, columns: Any = None):
        self.total, self.console, self.clock = total_steps, console, clock
        self.columns = list(columns or COLUMNS)  # (label, metric key, format): the run mode's own
        self.start = clock()
        self.phase_name, self.phase_start = "loading libraries", self.start
        self.step_start: float | None = None  # when the step now running began
        self.next_step = first_step
        self.durations: list[float] = []  # wall seconds of each step seen, eval and checkpoints included
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.live = (Live(_Screen(self), console=console, refresh_per_second=4, transient=False)
                     if console.is_terminal else None)

    def __enter__(self) -> LiveDisplay:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    # ---- callbacks
    def phase(self, name: str, detail: str = "") -> None:
        """A start-up phase begins (``model``, ``engines``, ``connect``, ``data``, ``weights``, ``train``)."""
        now = self.clock()
        text = STARTUP.get(name, name) + (f": {detail}" if detail else "")
        self.phase_name, self.phase_start = text, now
        if name == "train":
            self.step_start = now
        self.console.print(f"[{now - self.start:6.1f}s] {text}", markup=False, highlight=False, soft_wrap=True)

    def update(self, step: int, metrics: dict[str, Any], samples: list[Any] = ()) -> None:
        now = self.clock()
        began = self.step_start if self.step_start is not None else now - float(metrics.get("perf/step_time", 0.0))
        self.durations.append(now - began)
        self.step_start, self.next_step = now, step + 1
        self.rows.append((step, metrics))
        if self.live is None:
            self.console.print(self.line(step, metrics), markup=False, highlight=False, soft_wrap=True)

    # ---- estimates
    def eta_seconds(self, step: int) -> float | None:
        """Seconds left after ``step`` (0-based): steps left x the mean of the recent steady steps (all but
        the first; the first alone while it is all there is)."""
        steady = self.durations[1:] or self.durations
        if not steady:
            return None
        recent = steady[-ETA_WINDOW:]
        return (self.total - step - 1) * sum(recent) / len(recent)

    def eta(self, step: int) -> str:
        text = eta_text(self.eta_seconds(step))
        return f"~{text}" if len(self.durations) < 2 else text  # from the warm-up step only: an upper bound

    # ---- rendering
    def line(self, step: int, m: dict[str, Any]) -> str:
        parts = [f"step {step + 1}/{self.total}"]
        parts += [f"{name} {fmt.format(m[key])}" for name, key, fmt in self.columns if m.get(key) is not None]
        phases = " ".join(f"{p} {m[f'perf/time_{p}']:.2f}s" for p in PHASES if f"perf/time_{p}" in m)
        return "  ".join(parts) + (f"  ({phases})" if phases else "") + f"  eta {self.eta(step)}"

    def table(self, width: int) -> Table:
        """The last steps; phase columns only when they fit ``width`` with the others."""
        table = self._table(with_phases=True)
        natural = self.console.measure(table, options=self.console.options.update_width(10 * width)).maximum
        if natural > width:
            table = self._table(with_phases=False)
        return table

    def _table(self, with_phases: bool) -> Table:
        phases = PHASES if with_phases else ()
        table = Table("step", *[c[0] for c in self.columns], *[p.replace("_", " ") for p in phases],
                      box=None, pad_edge=False)
        for col in table.columns[1:]:
            col.justify = "right"
        for step, m in self.rows[-ROWS_SHOWN:]:
            cells = [fmt.format(m[key]) if m.get(key) is not None else "" for _, key, fmt in self.columns]
            cells += [f"{m[f'perf/time_{p}']:.2f}" if f"perf/time_{p}" in m else "" for p in phases]
            table.add_row(f"{step + 1}/{self.total}", *cells)
        return table

    def status(self) -> Text:
        """The line under the table: what runs now, for how long, and the ETA."""
        now = self.clock()
        if self.step_start is None:  # still starting up
            text = f"{self.phase_name}  {now - self.phase_start:.0f}s  (total {now - self.start:.0f}s)"
        else:
            eta = f"  eta {self.eta(self.rows[-1][0])}" if self.rows else ""
            text = f"step {self.next_step + 1}/{self.total}  {now - self.step_start:.0f}s{eta}"
        return Text(text, no_wrap=True, overflow="ellipsis")


class _Screen:
    """The live region, rebuilt at every refresh so the elapsed seconds tick."""

    def __init__(self, display: LiveDisplay):
        self.display = display

    def __rich_console__(self, console: Console, options: Any):
        d = self.display
        parts: list[Any] = [d.table(options.max_width)] if d.rows else []
        if d.next_step < d.total:
            parts.append(Spinner("dots", d.status()))
        yield Group(*parts)
