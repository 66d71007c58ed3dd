import json
import math
import time

from posttrain.core.metrics import MetricsWriter, read_metrics


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
