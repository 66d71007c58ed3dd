"""The quickstart end to end: wall time from the command to the last step, reward, and step time by phase.

    python bench/e2e.py [--config examples/quickstart.yaml] [key=value ...]

Runs ``rl-cli run`` in a fresh process (start-up of trainer, engine and router included) and prints one
JSON line: wall seconds, steps, mean reward of the first and last 10 steps, and the median seconds per
phase (generate, log_probs, train, sync) and per step. Target (the loop issue): last-10 reward >= 0.8
within 120 s on the 2-core CPU machine, starting from <= 0.2.
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

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", args.config, "--run-dir", str(run),
                              *args.overrides], capture_output=True, text=True)
        wall = time.perf_counter() - start
        if out.returncode:
            sys.exit(f"rl-cli run failed ({out.returncode}):\n{out.stderr[-3000:]}")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    reward = [r["rollout/reward_mean"] for r in rows]
    phases = {p: round(statistics.median(r[f"perf/time_{p}"] for r in rows), 4)
              for p in ("generate", "log_probs", "train", "sync")}
    result = {
        "bench": "e2e", "config": Path(args.config).name, "overrides": args.overrides,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "wall_s": round(wall, 1), "steps": len(rows),
        "reward_first10": round(statistics.mean(reward[:10]), 3), "reward_last10": round(statistics.mean(reward[-10:]), 3),
        "step_s_median": round(statistics.median(r["perf/step_time"] for r in rows), 4),
        "phase_s_median": phases, "startup_and_teardown_s": round(wall - sum(r["perf/step_time"] for r in rows), 1),
    }
    result["target_met"] = result["reward_last10"] >= 0.8 and wall <= 120 and result["reward_first10"] <= 0.2
    print(json.dumps(result))


if __name__ == "__main__":
    main()
