"""What ``rl-cli run`` shows while training: a live panel on a terminal, one plain line per step elsewhere."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

COLUMNS = [("reward", "rollout/reward_mean", "{:.3f}"), ("kl", "train/kl", "{:.4f}"),
           ("entropy", "train/entropy", "{:.3f}"), ("resp len", "rollout/response_len_mean", "{:.1f}"),
           ("tok/s", "perf/rollout_tokens_per_s", "{:.0f}"), ("step s", "perf/step_time", "{:.2f}")]
PHASES = ("generate", "log_probs", "train", "sync")


class LiveDisplay:
    def __init__(self, total_steps: int, console: Console, columns: Any = None):
        self.total, self.console = total_steps, console
        self.columns = list(columns or COLUMNS)  # (label, metric key, format): the run mode's own
        self.start = time.perf_counter()
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.live = Live(self._table(), console=console, refresh_per_second=4) if console.is_terminal else None

    def __enter__(self) -> LiveDisplay:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, step: int, metrics: dict[str, Any], samples: list[Any] = ()) -> None:
        self.rows.append((step, metrics))
        if self.live is not None:
            self.live.update(self._table())
        else:
            self.console.print(self._line(step, metrics), highlight=False, markup=False)

    def _eta(self, step: int) -> str:
        done = len(self.rows)
        left = (time.perf_counter() - self.start) / max(done, 1) * (self.total - step - 1)
        return f"{left:.0f}s"

    def _line(self, step: int, m: dict[str, Any]) -> str:
        parts = [f"step {step + 1}/{self.total}"]
        parts += [f"{name} {fmt.format(m[key])}" for name, key, fmt in self.columns if m.get(key) is not None]
        phases = " ".join(f"{p} {m[f'perf/time_{p}']:.2f}s" for p in PHASES if f"perf/time_{p}" in m)
        return "  ".join(parts) + (f"  [{phases}]" if phases else "") + f"  eta {self._eta(step)}"

    def _table(self) -> Table:
        table = Table("step", *[c[0] for c in self.columns], *[f"{p} s" for p in PHASES], "eta",
                      title="posttrain", box=None, pad_edge=False)
        for step, m in self.rows[-15:]:
            cells = [fmt.format(m[key]) if m.get(key) is not None else "" for _, key, fmt in self.columns]
            phases = [f"{m[f'perf/time_{p}']:.2f}" if f"perf/time_{p}" in m else "" for p in PHASES]
            table.add_row(f"{step + 1}/{self.total}", *cells, *phases, self._eta(step))
        return table
