import json
import math

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
