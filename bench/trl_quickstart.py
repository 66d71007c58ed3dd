"""Our quickstart against TRL's ``GRPOTrainer`` on the same task and model, back to back, on the CPU.

    python bench/trl_quickstart.py [--steps 10] [--rounds 1] [--venv /tmp/posttrain-trl-venv] [--trl trl==1.16.0]

1. posttrain: ``rl-cli run examples/quickstart.yaml rollout.num_rollouts=STEPS`` (GRPO, 64 prompts x 16
   samples, one new token, Megatron-core trainer, local engine), seconds per step from its metrics.
2. TRL: ``GRPOTrainer`` on the same prompts (``examples/quickstart/prompts.jsonl``), the same initial
   model and character vocabulary (the run's ``hf-init`` checkpoint: tiny Qwen3 shape), the same batch
   (64 prompts x 16 generations, ``max_completion_length`` 1, one optimizer step per batch), lr 3e-3, Adam
   betas (0.9, 0.98), grad clip 1, temperature 1, beta 0 (no reference), exact-match reward, on the CPU.
   Seconds per step from a callback around each optimizer step (generation included).

TRL is not a project dependency: it goes into its own virtual environment (``--venv``), created on the
first call with ``pip install TRL`` from PyPI. That environment sees this interpreter's packages through a
``.pth`` file (torch and transformers at the versions posttrain runs with, so both sides use the same
kernels); what TRL needs beyond them (trl, datasets, ...) is installed into it alone.

Prints one JSON line per side: ``step_s_median`` over the steps after the first (warm-up excluded),
``step_s_mean``, ``reward_first5``/``reward_last5``, ``wall_s``; the TRL line adds ``ours_over_trl``
(our median seconds per step / TRL's: <= 1 is the target). ``--rounds R`` runs R such pairs, each
line tagged with its ``round``, and ends with a summary line (every round's ratio and their median): on a
2-core box one pair's ratio swings by +-0.2 from minute to minute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ensure_venv(venv: Path, trl: str) -> Path:
    """The TRL environment's python, created (with ``trl`` installed) if missing."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # this interpreter's packages (torch, transformers) after the venv's own
    (Path(site) / "_posttrain_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", trl], check=True)
    return python


def ours(steps: int, run: Path) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", str(ROOT / "examples" / "quickstart.yaml"),
                          f"rollout.num_rollouts={steps}", "checkpoint.hf_init_weights=true",  # TRL starts from them
                          "--run-dir", str(run)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"rl-cli run failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["perf/step_time"] for r in rows]
    rewards = [r["rollout/reward_mean"] for r in rows]
    return summary("posttrain", times, rewards, wall)


def summary(side: str, times: list[float], rewards: list[float], wall: float) -> dict:
    later = times[1:] or times
    return {"bench": "trl_quickstart", "side": side, "steps": len(times),
            "step_s_median": round(statistics.median(later), 4), "step_s_mean": round(statistics.mean(later), 4),
            "reward_first5": round(statistics.mean(rewards[:5]), 3), "reward_last5": round(statistics.mean(rewards[-5:]), 3),
            "wall_s": round(wall, 1), "machine": f"{platform.machine()} {os.cpu_count()} cpus",
            "load": round(os.getloadavg()[0], 2)}


def trl_worker(model_dir: str, steps: int, out: str) -> None:
    """Runs in the TRL environment: GRPOTrainer on the quickstart task; writes step times and rewards."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    rows = [json.loads(line) for line in (ROOT / "examples" / "quickstart" / "prompts.jsonl").read_text().splitlines()]
    data = Dataset.from_list([{"prompt": r["prompt"], "label": str(r["label"])} for r in rows] * 1000)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rewards: list[float] = []

    def exact_match(completions, label, **_):
        scores = [float(" ".join(c.split()) == lab.strip()) for c, lab in zip(completions, label)]
        rewards.append(sum(scores) / len(scores))
        return scores

    wanted = dict(output_dir=str(Path(out).parent / "trl-out"), per_device_train_batch_size=1024,
                  gradient_accumulation_steps=1, num_generations=16,
                  steps_per_generation=1, num_iterations=1, max_completion_length=1, temperature=1.0, beta=0.0,
                  learning_rate=3e-3, adam_beta1=0.9, adam_beta2=0.98, weight_decay=0.0, max_grad_norm=1.0,
                  lr_scheduler_type="constant", warmup_steps=0, max_steps=steps, logging_steps=1, report_to=[],
                  save_strategy="no", use_cpu=True, bf16=False, fp16=False, seed=0, shuffle_dataset=True,
                  dataloader_num_workers=0, disable_tqdm=True)
    fields = set(GRPOConfig.__dataclass_fields__)
    args = GRPOConfig(**{k: v for k, v in wanted.items() if k in fields})
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    Path(out).write_text(json.dumps({"times": times, "rewards": rewards, "trl": __import__("trl").__version__}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="ours-then-TRL pairs; > 1 adds a summary line")
    parser.add_argument("--venv", default=str(Path(tempfile.gettempdir()) / "posttrain-trl-venv"))
    parser.add_argument("--trl", default="trl==1.16.0", help="the pip requirement for TRL")
    parser.add_argument("--trl-worker", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker[0], args.steps, args.trl_worker[1])
        return
    python = ensure_venv(Path(args.venv), args.trl)
    ratios = []
    for r in range(args.rounds):  # rounds alternate the sides: the box's speed drifts minute to minute
        mine, theirs = one_round(python, args.steps)
        ratios.append(theirs["ours_over_trl"])
        for line in (mine, theirs):
            print(json.dumps({**line, "round": r}), flush=True)
    if args.rounds > 1:
        print(json.dumps({"bench": "trl_quickstart", "side": "summary", "rounds": args.rounds, "ratios": ratios,
                          "ours_over_trl_median": round(statistics.median(ratios), 3)}))


def one_round(python: Path, steps: int) -> tuple[dict, dict]:
    """Ours, then TRL from our run's initial checkpoint: ``(our summary, TRL's with ours_over_trl)``."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        mine = ours(steps, run)
        out = Path(tmp) / "trl.json"
        t0 = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
        done = subprocess.run([str(python), __file__, "--steps", str(steps), "--trl-worker", str(run / "hf-init"),
                               str(out)], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        if done.returncode:
            sys.exit(f"TRL run failed:\n{done.stderr[-4000:]}")
        result = json.loads(out.read_text())
    theirs = summary("trl", result["times"], result["rewards"], wall)
    theirs.update(trl=result["trl"], ours_over_trl=round(mine["step_s_median"] / theirs["step_s_median"], 3))
    return mine, theirs

if __name__ == "__main__":
    main()
