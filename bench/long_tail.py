"""Long-tail responses: fully async vs one-step-off (``async``) vs ``sync``, back to back.

    python bench/long_tail.py [--steps 20] [--modes sync,async,fully_async] [key=value ...]

The task (``bench/long_tail_task.py``, loaded with ``--plugin``): the quickstart's tiny model and prompts,
rewarded on the first character, with response lengths that have a long tail: most responses are 4
tokens, 10% run to ``max_new_tokens`` (128). In sync mode each step waits for its longest responses;
``async`` overlaps the next step's generation with training; ``fully_async`` (``max_staleness: 2``,
``partial: true``) never stops generating. Prints one JSON line per mode: wall seconds (start-up
included), the median and mean step time after the first step, the mean reward of the first and last 5
steps (equal steps across modes), response lengths, staleness and dropped samples.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": {}, "async": {"mode": "async"},
         "fully_async": {"mode": "fully_async", "max_staleness": 2, "partial": True}}


def config(steps: int) -> dict:
    return {
        "seed": 0, "model": {"name": "qwen3", "preset": "tiny", "dtype": "float32", "tokenizer": "char"},
        "data": {"path": str(ROOT / "examples" / "quickstart" / "prompts.jsonl"), "epochs": 1000},
        "rollout": {"rollout_batch_size": 16, "n_samples_per_prompt": 8, "num_rollouts": steps, "temperature": 1.0,
                    "max_new_tokens": 128, "seed_sampling": True},
        "generator": {"name": "long_tail", "short": 4, "long_frac": 0.1},
        "estimator": "grpo", "loss": "ppo_clip", "rewards": [{"name": "label_prefix", "weight": 1.0}],
        "trainer": {"global_batch_size": 128, "micro_batch_size": 128, "lr": 3.0e-3, "entropy_coef": 0.005,
                    "backend": {"name": "megatron"}},
    }


def run_mode(mode: str, steps: int, overrides: list[str]) -> dict:
    cfg = config(steps)
    cfg["rollout"].update(MODES[mode])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "long_tail.yaml"
        path.write_text(yaml.safe_dump(cfg))
        run = Path(tmp) / "run"
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", str(path), "--run-dir", str(run),
                              "--plugin", str(ROOT / "bench" / "long_tail_task.py"), *overrides],
                             capture_output=True, text=True)
        wall = time.perf_counter() - start
        if out.returncode:
            sys.exit(f"{mode}: rl-cli run failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    reward = [r["rollout/reward_mean"] for r in rows]
    return {"bench": "long_tail", "mode": mode, "overrides": overrides,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus", "load": os.getloadavg()[0],
            "wall_s": round(wall, 1), "steps": len(rows),
            "steady_step_s_median": round(statistics.median(r["perf/step_time"] for r in later), 3),
            "steady_step_s_mean": round(statistics.mean(r["perf/step_time"] for r in later), 3),
            "train_s_total": round(sum(r["perf/step_time"] for r in rows), 1),
            "reward_first5": round(statistics.mean(reward[:5]), 3),
            "reward_last5": round(statistics.mean(reward[-5:]), 3),
            "response_len_mean": round(statistics.mean(r["rollout/response_len_mean"] for r in rows), 1),
            "response_len_max": max(r["rollout/response_len_max"] for r in rows),
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
            "dropped_stale": sum(r.get("rollout/dropped_stale", 0.0) for r in rows),
            "partial_continued": max(r.get("rollout/partial_continued", 0.0) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="sync,async,fully_async")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        print(json.dumps(run_mode(mode, args.steps, args.overrides)), flush=True)


if __name__ == "__main__":
    main()
