"""``python -m bench NAME``: every benchmark script has a name, each name picks the arguments of the hardware
present, and a benchmark that cannot run here is one line on stderr with exit code 2."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def bench_main():
    spec = importlib.util.spec_from_file_location("bench_main", ROOT / "bench" / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run(*args):
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_every_benchmark_script_is_named():
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")} - {"__main__.py", "long_tail_task.py"}
    assert {b.script for b in bench_main().BENCHES.values()} == scripts


def test_the_arguments_follow_the_gpus_present():
    main = bench_main()
    script = str(ROOT / "bench" / "weight_sync.py")
    example = "examples/gpu/qwen3-1.7b-grpo.yaml"
    assert main.command("weight-sync", [], 0)[1:] == [script, "examples/quickstart.yaml"]
    assert main.command("weight-sync", [], 1)[1:] == [script, example, "resources.colocate=true"]
    assert main.command("weight-sync", [], 2)[1:] == [script, example]
    # arguments given are passed as they are, whatever the hardware
    assert main.command("weight-sync", ["x.yaml"], 2)[1:] == [script, "x.yaml"]
    # a CPU-only benchmark runs on the CPU of a GPU machine
    assert main.command("rewards", [], 1)[1:] == [str(ROOT / "bench" / "rewards.py")]


def test_a_gpu_benchmark_without_a_gpu_and_an_unknown_name_are_one_line_errors():
    main = bench_main()
    with pytest.raises(ValueError, match="'pin-memory' needs a CUDA GPU"):
        main.command("pin-memory", [], 0)
    with pytest.raises(ValueError, match="needs arguments"):
        main.command("pipelines", [], 1)
    out = run("trainn")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("error: unknown benchmark 'trainn'; valid: cli-startup, e2e, e2e-moe, train, train-moe, "
                          "rollout, rollout-moe, decode-parts, generate-step, weight-sync, pin-memory, losses, "
                          "rewards, long-tail, trl-quickstart, trl-gpu, vlm, pipelines\n")


def test_dry_run_prints_the_command_for_this_machine():
    out = run("train", "--dry-run")
    assert out.returncode == 0, out.stderr
    gpu = bench_main().gpu_count()
    expected = ("--device cuda --preset qwen3-1.7B" if gpu else
                "--preset tiny --micro-batch 4 --seq-len 256 --steps 10 --warmup 3")
    assert out.stdout.startswith("python bench/train.py " + expected)


def test_a_named_benchmark_prints_its_json_line():
    out = run("cli-startup", "--repeat", "1")
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["bench"] == "cli_startup" and line["repeat"] == 1 and line["plugins_list"]["median_s"] > 0
