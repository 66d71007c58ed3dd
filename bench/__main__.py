"""Run one named benchmark on the hardware present; it prints its JSON line(s).

    python -m bench                      # the list: name, hardware, what it measures
    python -m bench NAME                 # NAME with the arguments of its table in bench/README.md for this machine
    python -m bench NAME ARG...          # NAME with exactly these arguments (the script's own flags)
    python -m bench NAME --dry-run       # print the command instead of running it

Each benchmark is a script in ``bench/`` run in a fresh process from the repository root. Without arguments
it gets the arguments that produced its current result: the GPU shape where CUDA answers (with one GPU or
two where the benchmark places roles on two), the CPU shape otherwise. A benchmark that needs a GPU on a
machine without one is a one-line error (exit 2), as is an unknown name.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_EXAMPLE = "examples/gpu/qwen3-1.7b-grpo.yaml"


@dataclass(frozen=True)
class Bench:
    """One benchmark: its script, what it measures, and its arguments by hardware (``None``: not on that
    hardware; ``two_gpus``: the arguments where two GPUs answer, else ``gpu``)."""

    script: str
    what: str
    cpu: list[str] | None = field(default_factory=list)
    gpu: list[str] | None = field(default_factory=list)
    two_gpus: list[str] | None = None


BENCHES: dict[str, Bench] = {
    "cli-startup": Bench("cli_startup.py", "wall time of `rl-cli plugins list` and `rl-cli --help`"),
    "e2e": Bench("e2e.py", "a whole run: wall time, reward curve, seconds per step by phase (GPU: colocated GRPO "
                 "at the Qwen3-1.7B shape, 5 steps)",
                 gpu=["--config", GPU_EXAMPLE, "--name", "colocated", "resources.colocate=true",
                      "rollout.num_rollouts=5"]),
    "e2e-moe": Bench("e2e.py", "colocated GRPO on Qwen3-30B-A3B cut to 8 layers, routing replay on", cpu=None,
                     gpu=["--config", "examples/gpu/qwen3-30b-a3b-grpo.yaml", "--name", "moe_grpo"]),
    "train": Bench("train.py", "one full train step (forward, backward, optimizer): tokens/s, model TFLOP/s",
                   cpu=["--preset", "tiny", "--micro-batch", "4", "--seq-len", "256", "--steps", "10", "--warmup", "3"],
                   gpu=["--device", "cuda", "--preset", "qwen3-1.7B", "--seq-len", "2048", "--micro-batch", "16",
                        "--grad-accum", "2", "--steps", "3", "--warmup", "1", "--sdpa-gqa", "--compile",
                        "--keep-logits", "--fused-adam"]),
    "train-moe": Bench("train.py", "the train step of Qwen3-30B-A3B cut to 8 layers (TFLOP/s on active parameters)",
                       cpu=["--spec", "qwen3_moe", "--preset", "tiny", "--layers", "3", "--micro-batch", "2",
                            "--seq-len", "32", "--steps", "1", "--warmup", "1"],
                       gpu=["--device", "cuda", "--spec", "qwen3_moe", "--preset", "qwen3-30B-A3B", "--layers", "8",
                            "--micro-batch", "4", "--seq-len", "2048", "--grad-accum", "2", "--steps", "2",
                            "--warmup", "1", "--sdpa-gqa", "--keep-logits", "--fused-adam"]),
    "rollout": Bench("rollout.py", "decode throughput of the local engine (tok/s, fraction of the bandwidth bound)",
                     gpu=["--device", "cuda", "--shape", "qwen3-1.7b", "--prompts", "256", "--prompt-len", "128",
                          "--new-tokens", "256", "--skip-hf", "--profile", "--variants", "triton+compile"]),
    "rollout-moe": Bench("rollout.py", "decode throughput at Qwen3-30B-A3B cut to 8 layers",
                         cpu=["--shape", "tiny-moe", "--layers", "3", "--skip-hf"],
                         gpu=["--device", "cuda", "--shape", "qwen3-30b-a3b", "--layers", "8", "--prompts", "256",
                              "--prompt-len", "128", "--new-tokens", "256", "--skip-hf", "--variants", "triton"]),
    "decode-parts": Bench("decode_parts.py", "the parts of one decode step alone: attention kernel, sampler, matmuls",
                          cpu=None, gpu=["--attention", "--gemms"]),
    "generate-step": Bench("generate_step.py", "one quickstart step's generate through client and engine server "
                           "(wall and CPU seconds per round)", gpu=None),
    "weight-sync": Bench("weight_sync.py", "seconds per full weight push trainer -> engines",
                         cpu=["examples/quickstart.yaml"], gpu=[GPU_EXAMPLE, "resources.colocate=true"],
                         two_gpus=[GPU_EXAMPLE]),
    "pin-memory": Bench("pin_memory.py", "making the offload's pinned host buffer: seconds and copy bandwidth",
                        cpu=None),
    "losses": Bench("losses.py", "an estimator and a policy loss, forward and backward, on a 4096 x 4096 batch",
                    gpu=["--device", "cuda"]),
    "rewards": Bench("rewards.py", "`math` reward throughput, inline and in worker processes", gpu=None),
    "long-tail": Bench("long_tail.py", "sync vs async vs fully_async on long-tail response lengths", gpu=None),
    "trl-quickstart": Bench("trl_quickstart.py", "our CPU quickstart step against TRL's GRPOTrainer on the same task",
                            cpu=["--steps", "30", "--rounds", "3"], gpu=None),
    "trl-gpu": Bench("trl_gpu.py", "TRL's GRPOTrainer on the GPU example's workload (the other side of e2e on a GPU)",
                     cpu=None),
    "vlm": Bench("vlm.py", "vision-language GRPO, colocated on one GPU at the Qwen2.5-VL-3B shape (random init, drawn "
                 "224 x 224 images): step time by phase, engine/trainer log-prob gap, peak GiB",
                 cpu=["--shape", "tiny", "--steps", "3"],
                 gpu=["--shape", "qwen2.5-vl-3b", "--device", "cuda", "--steps", "5", "--prompts", "64",
                      "--samples", "8", "--new-tokens", "128", "--image-size", "224", "--micro-batch", "16"]),
    "pipelines": Bench("pipelines.py", "steps to reward 0.8, distillation gap: read from run directories "
                       "(arguments: steps-to RUN_DIR | distill TEACHER_RUN STUDENT_RUN)", cpu=None, gpu=None),
}


def gpu_count() -> int:
    """CUDA devices this process sees (0 without torch's CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def command(name: str, args: list[str], gpus: int) -> list[str]:
    """The argv that runs benchmark ``name``: ``args`` as given, or (none given) the arguments for ``gpus``
    GPUs. Raises ``ValueError`` with the one-line reason when it cannot run here."""
    if name not in BENCHES:
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(BENCHES)}")
    bench = BENCHES[name]
    if not args:
        if bench.cpu is None and bench.gpu is None:
            raise ValueError(f"benchmark {name!r} needs arguments: {bench.what}")
        chosen = (bench.two_gpus if gpus >= 2 and bench.two_gpus is not None else bench.gpu) if gpus else bench.cpu
        if chosen is None and gpus:
            chosen = bench.cpu  # a CPU benchmark runs on the CPU of a GPU machine too
        if chosen is None:
            raise ValueError(f"benchmark {name!r} needs a CUDA GPU and this machine has none (or pass its "
                             "arguments yourself)")
        args = chosen
    return [sys.executable, str(ROOT / "bench" / bench.script), *args]


def listing(gpus: int) -> str:
    """One line per benchmark: name, the hardware it runs on, what it measures."""
    rows = []
    for name, bench in BENCHES.items():
        where = "/".join(w for w, a in (("cpu", bench.cpu), ("gpu", bench.gpu)) if a is not None) or "args"
        rows.append(f"{name:<15} {where:<8} {bench.what}")
    return f"benchmarks ({gpus} GPU(s) here; `python -m bench NAME`):\n" + "\n".join(rows)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(listing(gpu_count()))
        return 0
    dry = "--dry-run" in argv
    name, *args = [a for a in argv if a != "--dry-run"]
    try:
        cmd = command(name, args, gpu_count() if not args else 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if dry:
        print(shlex.join(["python", str(Path(cmd[1]).relative_to(ROOT)), *cmd[2:]]))
        return 0
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
