"""Where a run's numbers go: ``RUN_DIR/metrics.jsonl`` (one JSON object per step), TensorBoard, W&B.

Keys are ``section/name`` (``rollout/reward_mean``, ``train/loss``, ``perf/step_time``); every line
also has ``step``, counted from 1 as the console counts (TensorBoard's and W&B's step axis are the same number). ``read_metrics(run_dir)`` reads them back (``rl-cli plot``, resume, tests).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from posttrain.core.gpu_memory import GIB

log = logging.getLogger("posttrain.metrics")

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Append-only metrics sink. Lines are flushed per step so a killed run loses at most one step."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str | None = None, config: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # the driver imports torch anyway

            # its writer thread flushes every 5 s (and at close): a flush per step cost ~3 ms of a CPU step
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), flush_secs=5)
        self._wandb = None
        if wandb:
            import wandb as wandb_lib  # optional dependency: posttrain[wandb]

            from posttrain.core.secrets import redact

            self._wandb = wandb_lib.init(project=wandb_project or "posttrain", config=redact(config or {}),
                                         dir=str(self.run_dir), name=self.run_dir.name)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` (numbers; non-finite values are written as null) for step ``step`` (from 1)."""
        clean = {k: _number(v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()  # in the OS's hands: a killed run loses no line (fsync waits for the disk: see sync)
        if self._tb is not None:
            for key, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None}, step=step)

    def truncate_after(self, steps: int) -> None:
        """Drop lines of steps after the first ``steps`` (a resumed run re-does them; no step appears twice)."""
        self._file.close()
        truncate_jsonl(self.run_dir / METRICS_FILE, steps)
        self._file = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")

    def sync(self) -> None:
        """Make the lines written so far durable (``fsync``): called with every checkpoint, so the metrics of
        the steps a resume keeps survive an OS crash too. Not per step: it cost ~30 ms a step on a small
        disk, a tenth of a CPU quickstart step, and a resume drops the lines after its checkpoint anyway."""
        os.fsync(self._file.fileno())
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self.sync()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the lines of ``path`` whose ``step`` is at most ``step`` (atomically replaced)."""
    kept = [row for row in read_jsonl(path) if row["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
    os.replace(tmp, path)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete line of ``RUN_DIR/metrics.jsonl`` (a torn last line from a crash is skipped)."""
    return read_jsonl(Path(run_dir) / METRICS_FILE)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (none if it does not exist)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _number(value: Any) -> float | int | None:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


class PhaseTimer:
    """Wall time per phase of a step: ``with timer("train"): ...``; ``pop()`` gives ``perf/time_<phase>``.
    With a ``memory`` watch (``gpu_memory.MemoryWatch``: the GPUs' used memory, every process's), also
    ``perf/gpu_peak_gib_<phase>``: the most the devices held while the phase ran (a phase met twice in a step:
    the higher)."""

    def __init__(self, memory: Any = None):
        self.times: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self.memory = memory

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        with self.memory.window() if self.memory is not None else nullcontext() as window:
            try:
                yield
            finally:
                self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start
        if window is not None:
            self.peaks[phase] = max(self.peaks.get(phase, 0), window.peak)

    def pop(self) -> dict[str, float]:
        out = {f"perf/time_{k}": v for k, v in self.times.items()}
        out.update({f"perf/gpu_peak_gib_{k}": v / GIB for k, v in self.peaks.items()})
        self.times, self.peaks = {}, {}
        return out


class ServerMetrics:
    """A step's figures from the trainer and the engines' servers (``metrics(trainer, engines)`` once a step):

    - ``perf/trainer_*``: the trainer's memory figures; ``perf/engine_peak_gib``: the busiest engine's peak (GiB);
    - what the engines did since the last step, summed over engines, from the ``totals`` (counts since start)
      that posttrain's own engine reports in ``/get_server_info`` (an engine without them adds nothing):
      ``engine/prefill_steps``, ``engine/prefill_s`` (prefill batches and their seconds, first compiles
      included), ``engine/decode_steps``, ``engine/decode_s``, ``engine/decode_step_ms`` (their mean),
      ``engine/mean_batch`` (running requests per decode step), ``engine/graph_captures`` and
      ``engine/graph_capture_s`` (CUDA graphs captured, with the compiles they waited for). A slow
      ``perf/time_generate`` then shows whether prefills, decode steps or captures took the time.

    Engines on CPU are not asked (``engines.server_states`` gives them empty), so CPU runs have neither. An
    engine whose totals went down was restarted: its figures count from zero again.

    The trainer's two counts since its start, ``compiled_graphs`` and ``alloc_retries``, are also said in one
    warning each when they rise after the process's first step: a recompile (a train phase slower by the compile)
    or the GPU allocator's retries (memory near its limit) would otherwise show only as a slow step."""

    def __init__(self):
        self.last: list[dict[str, float]] = []
        self.trainer_counts: dict[str, float] | None = None  # the last step's; None before the first

    def __call__(self, trainer: Any, engines: Any) -> dict[str, float]:
        stats = trainer.memory_stats()
        self._warn_on_rises(stats)
        out = {f"perf/trainer_{k}": v for k, v in stats.items()}
        states = engines.server_states()
        peaks = [s["memory"]["peak_gib"] for s in states if "peak_gib" in s.get("memory", {})]
        if peaks:
            out["perf/engine_peak_gib"] = max(peaks)
        totals = [s.get("totals") or {} for s in states]
        done: dict[str, float] = {}
        for i, now in enumerate(totals):
            before = self.last[i] if i < len(self.last) else {}
            if any(now.get(k, 0) < v for k, v in before.items()):  # restarted since
                before = {}
            for k, v in now.items():
                done[k] = done.get(k, 0.0) + v - before.get(k, 0.0)
        self.last = totals
        if not done:
            return out
        out.update({f"engine/{k}": float(v) for k, v in done.items() if k != "decode_rows"})
        steps = done.get("decode_steps", 0)
        if steps:
            out["engine/decode_step_ms"] = 1e3 * done.get("decode_s", 0.0) / steps
            out["engine/mean_batch"] = done.get("decode_rows", 0.0) / steps
        return out

    def _warn_on_rises(self, stats: dict[str, float]) -> None:
        counts = {k: stats[k] for k in ("compiled_graphs", "alloc_retries") if k in stats}
        before, self.trainer_counts = self.trainer_counts, counts
        if before is None:  # the first step compiles and settles its memory: nothing to compare with
            return
        graphs = counts.get("compiled_graphs", 0) - before.get("compiled_graphs", 0)
        if graphs > 0:
            log.warning("trainer: %d more graph(s) compiled after the first step, a recompile that slows this step "
                        "by its compile (TORCH_LOGS=recompiles names the guard that failed)", graphs)
        retries = counts.get("alloc_retries", 0) - before.get("alloc_retries", 0)
        if retries > 0:
            log.warning("trainer: the GPU allocator found no free block %d time(s) this step and gave its cache "
                        "back each time (memory near its limit: a smaller trainer.max_tokens_per_micro_batch, or "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)", retries)
