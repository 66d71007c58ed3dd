"""The real-model recipes (`examples/gsm8k`, `examples/dapo-math`) run as written, on a tiny random checkpoint
of the same architecture with a tokenizer built here (the real weights are not in CI): two steps each, the
recipe's own config with only the model, the sizes and the placement overridden for a CPU."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
CPU = ["model.dtype=float32", "rollout.engine.device=cpu", "rollout.engine.max_running_requests=8",
       "rollout.engine.context_length=512", "resources.trainer_gpus_per_node=0", "resources.rollout_gpus=0",
       "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=16",
       "trainer.micro_batch_size=4", "trainer.backend.compile=false", "rollout.seed_sampling=true",
       "checkpoint.interval=0", "logging.tensorboard=false", "--smoke"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from posttrain.testing.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("recipes")
    # the recipes' architectures: Qwen2.5-Instruct (qwen2) and Qwen3; char-level tokenizer with a chat template
    return {family: make_tiny_checkpoint(root / family, family=family) for family in ("qwen2", "qwen3")}


def run(config, run_dir, *overrides):
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", str(config), "--run-dir", str(run_dir),
                          *CPU, *map(str, overrides)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_gsm8k_recipe_runs_with_its_chat_template_eval_and_math_reward(tiny, tmp_path):
    rows = run(ROOT / "examples" / "gsm8k" / "config.yaml", tmp_path / "run", f"model.path={tiny['qwen2']}",
               "trainer.global_batch_size=4", "eval.interval=1", "eval.datasets.0.limit=2")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("eval/gsm8k_test/reward_mean" in r and "rollout/reward_mean" in r for r in rows)
    served = json.loads((tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()[0])["prompts"][0]
    # the chat template and the system prompt reached the engine's prompt
    assert served.startswith("<|im_start|>system\nPlease reason step by step") and "<|im_start|>assistant\n" in served
    assert (tmp_path / "run" / "hf-final" / "config.json").is_file()


def test_dapo_recipe_runs_with_dynamic_sampling_and_the_overlong_penalty(tiny, tmp_path):
    # a random model's answers are all wrong (-1): stop strings vary the response lengths, so the overlong
    # penalty (ramping over the last 15 of 16 tokens) gives groups a reward spread for nonzero_std to keep
    rows = run(ROOT / "examples" / "dapo-math" / "config.yaml", tmp_path / "run", f"model.path={tiny['qwen3']}",
               "trainer.global_batch_size=2", "trainer.steps_per_rollout=2", "data.over_sampling_batch_size=4",
               "trainer.micro_batch_size=2", "rewards.1.max_len=16", "rewards.1.buffer=15",
               "rollout.stop=[a,e,o,t,n,s]", "eval.interval=0")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/samples"] == 4 and r["dynamic_sampling/kept"] == 2 for r in rows), rows  # full batches
    # dynamic sampling ran (which groups come back first, and so whether one was dropped, varies run to run)
    assert all(r["dynamic_sampling/sampled"] >= r["dynamic_sampling/kept"] for r in rows), rows
    assert all(r["rollout/reward_mean"] < -1.0 for r in rows)  # -1 (wrong) plus the overlong penalty
