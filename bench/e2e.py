"""The quickstart end to end: wall time from the command to the last step, reward, and step time by phase.

    python bench/e2e.py [--config examples/quickstart.yaml] [--name NAME] [key=value ...]
    python bench/e2e.py --config examples/gpu/qwen3-1.7b-grpo.yaml --name colocated resources.colocate=true

Runs ``rl-cli run`` in a fresh process (start-up of trainer, engine and router included) and prints one
JSON line: wall seconds, steps, mean reward of the first and last 10 steps, the median seconds per phase
(every ``perf/time_*`` the run logged: generate, release, log_probs, train, generate_wait, sync) and per
step, over all steps and over the steps after the first (``steady_*``: warm-up and CUDA-graph capture
excluded), and where logged the correctness and memory signals of GPU runs: the engine/trainer log-prob
gap and the reference/policy gap at step 0, weight-push seconds, peak GiB of trainer and engine.
Target (quickstart only): last-10 reward >= 0.8 within 120 s on the 2-core CPU machine,
starting from <= 0.2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return round(statistics.median(values), 4) if values else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--name", default=None, help="a label for the JSON line")
    parser.add_argument("--keep", default=None, help="copy metrics.jsonl and the engine logs here")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop the run after this many seconds; the steps done so far are still reported")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "posttrain.cli.main", "run", args.config, "--run-dir", str(run), *args.overrides]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            timed_out = False
        except subprocess.TimeoutExpired as exc:  # the engines end with the run (procs.exit_with_parent)
            text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
            out = subprocess.CompletedProcess(cmd, -9, text(exc.stdout), text(exc.stderr))
            timed_out = True
        wall = time.perf_counter() - start
        if args.keep:
            keep = Path(args.keep)
            keep.mkdir(parents=True, exist_ok=True)
            label = args.name or "run"
            (keep / f"{label}.out").write_text(out.stdout[-20000:] + "\n--- stderr ---\n" + out.stderr[-20000:])
            for f in [run / "metrics.jsonl", *sorted((run / "logs").glob("*.log"))]:
                if f.exists():
                    shutil.copy(f, keep / f"{label}-{f.name}")
        metrics = run / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        if out.returncode and not (timed_out and rows):
            print(out.stdout[-3000:], file=sys.stderr)
            logs = "".join(f"--- {f.name}: " + "".join(line for line in f.read_text(errors="replace").splitlines(True)
                                                      if "rror" in line or "Exception" in line)[-3000:]
                           for f in sorted((run / "logs").glob("*.log")))
            sys.exit(f"rl-cli run failed ({'timed out' if timed_out else out.returncode}):\n{out.stderr[-3000:]}\n{logs}")
    reward = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]  # none on a step left empty
    sampled = [r["dynamic_sampling/reward_mean"] for r in rows if "dynamic_sampling/reward_mean" in r]
    evals = {k: round(v, 3) for r in rows for k, v in r.items() if k.startswith("eval/") and k.endswith("/reward_mean")}
    phases = {k.removeprefix("perf/time_"): round(statistics.median(r.get(k, 0.0) for r in rows), 4)
              for k in rows[0] if k.startswith("perf/time_")}
    later = rows[1:] or rows
    steady = {k.removeprefix("perf/time_"): round(statistics.median(r.get(k, 0.0) for r in later), 4)
              for k in later[0] if k.startswith("perf/time_")}
    first = rows[0]
    signals = {"logprob_abs_diff_step0": first.get("train_rollout_logprob_abs_diff"),
               "logprob_abs_diff_max": max(r.get("train_rollout_logprob_abs_diff", 0.0) for r in rows),
               "ref_policy_abs_diff_step0": first.get("train/ref_policy_logprob_abs_diff"),
               "weight_push_s": [round(r["perf/weight_push_s"], 4) for r in rows if "perf/weight_push_s" in r],
               "trainer_peak_gib": max((r.get("perf/trainer_peak_gib", 0.0) for r in rows), default=None),
               "engine_peak_gib": max((r.get("perf/engine_peak_gib", 0.0) for r in rows), default=None),
               "rollout_tokens_per_s_steady": round(statistics.median(r["perf/rollout_tokens_per_s"] for r in later
                                                                      if "perf/rollout_tokens_per_s" in r)),
               "mfu_steady": _median(later, "perf/mfu"),
               "tokens_per_s_per_gpu_steady": _median(later, "perf/tokens_per_s_per_gpu"),
               "response_len_mean": round(statistics.mean(r["rollout/response_len_mean"] for r in rows
                                                          if "rollout/response_len_mean" in r), 1)}
    gpu_peaks = {k.removeprefix("perf/gpu_peak_gib_"): round(max(r.get(k, 0.0) for r in rows), 1)
                 for r in rows for k in r if k.startswith("perf/gpu_peak_gib_")}  # GPU runs (NVML): per phase
    if gpu_peaks:
        signals["gpu_peak_gib_by_phase"] = gpu_peaks
        signals["gpu_peak_gib_generate_by_step"] = [round(r.get("perf/gpu_peak_gib_generate", 0.0), 1) for r in rows]
    if any("perf/trainer_offloaded_gib" in r for r in rows):  # resources.offload_trainer
        signals["trainer_offloaded_gib"] = round(max(r.get("perf/trainer_offloaded_gib", 0.0) for r in rows), 2)
        signals["offload_wait_s_by_step"] = [round(r["train/offload_wait_s"], 3) for r in rows
                                             if "train/offload_wait_s" in r]  # what the passes did not hide
        signals["offload_pin_s"] = round(sum(r.get("train/offload_pin_s", 0.0) for r in rows), 2)  # host buffers made
    if sampled:  # with filters: the reward of every sampled group, the filtered ones too
        signals["sampled_reward_last10"] = round(statistics.mean(sampled[-10:]), 3)
    signals.update({"last_" + k: v for k, v in evals.items()})  # each eval set's last
    result = {
        "bench": "e2e", "name": args.name, "timed_out": timed_out, "config": Path(args.config).name, "overrides": args.overrides,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "wall_s": round(wall, 1), "steps": len(rows),
        "reward_first10": round(statistics.mean(reward[:10]), 3), "reward_last10": round(statistics.mean(reward[-10:]), 3),
        "step_s_median": round(statistics.median(r["perf/step_time"] for r in rows), 4),
        "phase_s_median": phases, "startup_and_teardown_s": round(wall - sum(r["perf/step_time"] for r in rows), 1),
        "steady_step_s_median": round(statistics.median(r["perf/step_time"] for r in later), 4),
        "steady_phase_s_median": steady, **signals,
    }
    if Path(args.config).name == "quickstart.yaml":
        result["target_met"] = result["reward_last10"] >= 0.8 and wall <= 120 and result["reward_first10"] <= 0.2
    print(json.dumps(result))


if __name__ == "__main__":
    main()
