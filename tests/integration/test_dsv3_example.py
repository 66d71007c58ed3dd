"""``examples/gpu/moonlight-16b-a3b-grpo.yaml`` end to end on the CPU: the file as written, its model swapped for
a tiny random ``deepseek_v3`` checkpoint (multi-head latent attention, group-limited routing, a dense first
layer) and its sizes and placement for a CPU; three steps of `rl-cli run` with routing replay."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
CPU = ["model.overrides={}", "model.dtype=float32", "rollout.engine.device=cpu", "rollout.engine.max_running_requests=8",
       "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8",
       "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "resources.trainer_gpus_per_node=0",
       "resources.rollout_gpus=0", "trainer.backend.fused_adam=false", "rollout.seed_sampling=true"]


def test_moonlight_example_runs_three_steps_on_a_tiny_deepseek_v3(tmp_path):
    from posttrain.testing.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="deepseek_v3")
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", "examples/gpu/moonlight-16b-a3b-grpo.yaml",
                          "--run-dir", str(run), f"model.path={ckpt}", *CPU],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the engine's MLA and routing, replayed in the trainer, give the trainer's log-probs
        assert r["train_rollout_logprob_abs_diff"] < 1e-4, r
        assert r["train/moe_aux_loss"] > 0 and r["rollout/samples"] == 8
    assert "done: 3 steps" in out.stdout
