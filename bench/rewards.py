"""Reward throughput: score N math samples (default 10,000) with the `math` reward (math-verify) through
RewardRunner with 1 worker (inline) and 2 worker processes. Prints ONE JSON line::

    {"bench": "rewards", "samples": 10000, "workers_1": {"samples_per_s": ...}, "workers_2": {...}, ...}

Worker start-up (spawned processes importing posttrain and math-verify) is measured separately and not
counted in samples/s. Run: ``python bench/rewards.py [--n 10000] [--workers 1,2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time


def make_groups(n: int, group_size: int = 8, seed: int = 0):
    """``n`` samples in groups of ``group_size`` sharing one problem (as in GRPO). Labels cycle through
    fractions, decimals, sets, equations, intervals and integers; each response writes the answer in
    its own form (LaTeX, plain, wrong by one), boxed, after "Answer:", or bare."""
    from posttrain.core.types import Sample

    rng = random.Random(seed)
    samples = []
    for i in range(n):
        g = i // group_size
        grng = random.Random(seed * 1_000_003 + g)
        a, b = grng.randint(1, 50), grng.randint(2, 60)
        kind = g % 6
        if kind == 0:
            label, forms = f"{a}/{b}", [rf"\frac{{{a}}}{{{b}}}", f"{a}/{b}", rf"\dfrac{{{a}}}{{{b}}}"]
        elif kind == 1:
            label, forms = str(a / 4), [rf"\dfrac{{{a}}}{{4}}", str(a / 4), f"{a}/4"]
        elif kind == 2:
            label, forms = rf"\{{{a},{b}\}}", [rf"\{{{b}, {a}\}}", rf"\{{{a},{b}\}}"]
        elif kind == 3:
            label, forms = str(a + b), [f"x = {a + b}", str(a + b)]
        elif kind == 4:
            label, forms = f"({a},{a + b}]", [f"({a}, {a + b}]", rf"\left({a},{a + b}\right]"]
        else:
            label, forms = str(a * b), [str(a * b), f"{a * b}.0"]
        answer = rng.choice(forms)
        if rng.random() < 0.4:  # a wrong answer
            answer = answer.replace(str(a), str(a + 1), 1)
        body = f"<think>Let me compute {a} and {b} step by step.</think> Therefore the answer is "
        style = rng.random()
        response = body + (rf"\boxed{{{answer}}}." if style < 0.8 else
                           f"\nAnswer: {answer}" if style < 0.9 else f"about {answer}")
        samples.append(Sample(prompt="q", response=response, label=label, index=i, group_index=g))
    return [samples[i:i + group_size] for i in range(0, n, group_size)]


async def measure(workers: int, n: int) -> dict:
    from posttrain.core.config import Selection
    from posttrain.core.plugins import load_plugins
    from posttrain.core.rewards import RewardRunner

    plugins = load_plugins()
    cls = plugins.rewards["math"]
    groups = make_groups(n)
    runner = RewardRunner([Selection("rewards", "math", cls.Config(), 1.0)], plugins, workers=workers)
    try:
        t0 = time.perf_counter()
        runner.warm_up()
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics = await runner.score_groups(groups)
        seconds = time.perf_counter() - t0
    finally:
        runner.close()
    return {"samples_per_s": round(n / seconds, 1), "seconds": round(seconds, 3),
            "startup_s": round(startup, 3), "mean_score": round(metrics.get("reward/math", 0.0), 4),
            "failed": int(metrics["reward/failed"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--workers", default="1,2")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = {"bench": "rewards", "reward": "math", "samples": args.n, "cpus": os.cpu_count()}
    for w in (int(x) for x in args.workers.split(",")):
        out[f"workers_{w}"] = asyncio.run(measure(w, args.n))
    print(json.dumps(out))


if __name__ == "__main__":  # spawned workers import this module: no work at import time
    main()
