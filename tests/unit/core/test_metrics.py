import json
import math
import time

from posttrain.core.metrics import MetricsWriter, ServerMetrics, read_metrics


def test_metrics_jsonl_and_tensorboard(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=True)
    writer.log(0, {"rollout/reward_mean": 0.25, "train/loss": float("nan"), "perf/n": 3})
    writer.log(1, {"rollout/reward_mean": 0.5})
    writer.close()
    rows = read_metrics(tmp_path)
    assert rows == [{"step": 0, "rollout/reward_mean": 0.25, "train/loss": None, "perf/n": 3},
                    {"step": 1, "rollout/reward_mean": 0.5}]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_torn_last_line_is_ignored_and_truncate_after(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(4):
        writer.log(step, {"x": step})
    writer.truncate_after(1)
    writer.log(2, {"x": 20})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "x"')
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0), (1, 1), (2, 20)]


def test_tensor_values_become_numbers(tmp_path):
    import torch

    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.log(0, {"a": torch.tensor(1.5), "b": torch.tensor(float("inf"))})
    writer.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["a"] == 1.5 and row["b"] is None and not math.isnan(row["a"])


def test_wandb_logging_writes_an_offline_run(tmp_path, monkeypatch):
    """``logging.wandb: true`` really initializes, logs and finishes a W&B run (offline: no network here).
    W&B's run file is protobuf records; the logged keys and values are in it as JSON strings."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    writer = MetricsWriter(tmp_path / "run", tensorboard=False, wandb=True, wandb_project="posttrain-test",
                           config={"seed": 7})
    writer.log(0, {"rollout/reward_mean": 0.125, "train/loss": float("nan")})
    writer.log(1, {"rollout/reward_mean": 0.875})
    writer.close()
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((tmp_path / "run").rglob("*"))
    deadline = time.monotonic() + 20  # W&B's service process may still be writing the file under load
    while b"0.875" not in (data := runs[0].read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"rollout/reward_mean" in data and b"0.875" in data and b"0.125" in data
    assert b"train/loss" not in data  # a non-finite value is not sent
    assert b"posttrain-test" in data and b"seed" in data  # project and run config


class _Trainer:
    def memory_stats(self):
        return {"peak_gib": 7.5}


class _Engines:
    """``server_states`` of two engines, one step's states at a time."""

    def __init__(self, *steps):
        self.steps = list(steps)

    def server_states(self):
        return self.steps.pop(0)


def _state(peak, **totals):
    return {"memory": {"peak_gib": peak}, "totals": totals}


def test_server_metrics_report_what_the_engines_did_since_the_last_step():
    first = [_state(3.0, prefill_steps=2, prefill_s=1.5, decode_steps=10, decode_rows=40, decode_s=0.5,
                    graph_captures=3, graph_capture_s=4.0),
             _state(5.0, prefill_steps=1, prefill_s=0.5, decode_steps=10, decode_rows=20, decode_s=0.3,
                    graph_captures=0, graph_capture_s=0.0)]
    second = [_state(3.0, prefill_steps=3, prefill_s=1.75, decode_steps=30, decode_rows=120, decode_s=1.5,
                     graph_captures=3, graph_capture_s=4.0),
              # restarted: its totals went down, so they count from zero
              _state(4.0, prefill_steps=1, prefill_s=0.25, decode_steps=20, decode_rows=40, decode_s=0.5,
                     graph_captures=1, graph_capture_s=0.5)]
    metrics = ServerMetrics()
    engines = _Engines(first, second)
    one = metrics(_Trainer(), engines)
    assert one["perf/trainer_peak_gib"] == 7.5 and one["perf/engine_peak_gib"] == 5.0
    assert one["engine/prefill_steps"] == 3 and one["engine/graph_captures"] == 3
    assert one["engine/decode_steps"] == 20 and math.isclose(one["engine/decode_step_ms"], 40.0)
    assert one["engine/mean_batch"] == 3.0 and "engine/decode_rows" not in one
    two = metrics(_Trainer(), engines)
    assert two["perf/engine_peak_gib"] == 4.0
    assert two["engine/prefill_steps"] == 1 + 1 and math.isclose(two["engine/prefill_s"], 0.25 + 0.25)
    assert two["engine/decode_steps"] == 20 + 20 and math.isclose(two["engine/decode_s"], 1.0 + 0.5)
    assert math.isclose(two["engine/decode_step_ms"], 1e3 * 1.5 / 40) and two["engine/mean_batch"] == 3.0
    assert two["engine/graph_captures"] == 1 and two["engine/graph_capture_s"] == 0.5


def test_server_metrics_without_engine_figures_report_the_trainer_only():
    """Engines not asked (CPU) or without ``totals`` (another server): no ``engine/`` keys, no engine peak."""
    metrics = ServerMetrics()
    out = metrics(_Trainer(), _Engines([{}, {"memory": {}}]))
    assert out == {"perf/trainer_peak_gib": 7.5}
    idle = ServerMetrics()
    engines = _Engines([_state(1.0, decode_steps=5, decode_s=0.1)], [_state(1.0, decode_steps=5, decode_s=0.1)])
    idle(_Trainer(), engines)
    quiet = idle(_Trainer(), engines)  # nothing ran between the two steps: zeros, and no mean of no steps
    assert quiet["engine/decode_steps"] == 0 and "engine/decode_step_ms" not in quiet


class _CountingTrainer:
    """``memory_stats`` with the trainer's two counts since its start, one step's figures at a time."""

    def __init__(self, *steps):
        self.steps = list(steps)

    def memory_stats(self):
        graphs, retries = self.steps.pop(0)
        return {"peak_gib": 1.0, "compiled_graphs": float(graphs), "alloc_retries": float(retries)}


def test_a_recompile_or_allocator_retries_after_the_first_step_are_said_once_each(caplog):
    """The first step compiles (and may retry) as it settles: nothing is said. After it, a rise in either count
    is one warning naming what to look at, and steps without a rise say nothing."""
    import logging

    metrics, engines = ServerMetrics(), _Engines(*[[] for _ in range(4)])
    trainer = _CountingTrainer((3, 2), (3, 2), (5, 2), (5, 6))
    with caplog.at_level(logging.WARNING, logger="posttrain.metrics"):
        first = metrics(trainer, engines)
        assert caplog.records == [] and first["perf/trainer_compiled_graphs"] == 3.0
        metrics(trainer, engines)
        assert caplog.records == []
        metrics(trainer, engines)
        (recompile,) = caplog.records
        assert "2 more graph(s) compiled after the first step" in recompile.getMessage()
        assert "TORCH_LOGS=recompiles" in recompile.getMessage()
        caplog.clear()
        last = metrics(trainer, engines)
    (retries,) = caplog.records
    assert "no free block 4 time(s) this step" in retries.getMessage()
    assert "trainer.max_tokens_per_micro_batch" in retries.getMessage() and last["perf/trainer_alloc_retries"] == 6.0
