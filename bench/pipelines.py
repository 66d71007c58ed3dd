"""Numbers of the multi-stage examples, read from their run directories (one JSON line each).

    python bench/pipelines.py steps-to RUN_DIR [--reward 0.8] [--window 10]
    python bench/pipelines.py distill TEACHER_RUN STUDENT_RUN [--window 10]

``steps-to``: the first step (1-based count of RL steps) at which the mean ``rollout/reward_mean`` of the
last ``window`` steps reaches ``reward`` (the quickstart's target: last-10 mean >= 0.8), or null.
``distill``: the teacher's and the student's last-``window`` mean reward (same task, same sampling), their
gap, and the student's ``estimator/reverse_kl`` (token mean of log p_student - log p_teacher on its own
samples) over its first and last ``window`` steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _rows(run: str) -> list[dict]:
    path = Path(run) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def steps_to(run: str, reward: float, window: int) -> dict:
    rewards = [r["rollout/reward_mean"] for r in _rows(run)]
    reached = next((i + 1 for i in range(window - 1, len(rewards))
                    if sum(rewards[i - window + 1:i + 1]) / window >= reward), None)
    return {"bench": "steps_to_reward", "run": run, "reward": reward, "window": window, "steps": len(rewards),
            "steps_to_reward": reached, "first10": _mean(rewards[:window]), "last10": _mean(rewards[-window:])}


def distill(teacher: str, student: str, window: int) -> dict:
    t, s = _rows(teacher), _rows(student)
    kl = [r["estimator/reverse_kl"] for r in s if "estimator/reverse_kl" in r]
    t_reward = _mean([r["rollout/reward_mean"] for r in t][-window:])
    s_reward = _mean([r["rollout/reward_mean"] for r in s][-window:])
    return {"bench": "distill", "teacher": teacher, "student": student, "window": window, "steps": len(s),
            "teacher_reward": t_reward, "student_reward": s_reward,
            "gap": None if t_reward is None or s_reward is None else round(t_reward - s_reward, 4),
            "student_first10_reward": _mean([r["rollout/reward_mean"] for r in s][:window]),
            "reverse_kl_first10": _mean(kl[:window]), "reverse_kl_last10": _mean(kl[-window:])}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("steps-to")
    a.add_argument("run")
    a.add_argument("--reward", type=float, default=0.8)
    a.add_argument("--window", type=int, default=10)
    b = sub.add_parser("distill")
    b.add_argument("teacher")
    b.add_argument("student")
    b.add_argument("--window", type=int, default=10)
    args = parser.parse_args()
    out = (steps_to(args.run, args.reward, args.window) if args.what == "steps-to"
           else distill(args.teacher, args.student, args.window))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
