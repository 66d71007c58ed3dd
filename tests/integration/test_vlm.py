"""The vision-language example end to end through ``rl-cli``: a bad image is one line at ``--dry-run``; two steps
of examples/vlm/config.yaml (fsdp2 + hf engine, images as image_data; one, then a resume for the second) with
the engine's log-probs equal to the trainer's, a checkpoint that resumes, and an ``hf-final/`` with the image processor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
CONFIG = ROOT / "examples" / "vlm" / "config.yaml"
SMALL = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=16",
         "trainer.micro_batch_size=8", "checkpoint.interval=1", "trainer.log_kl=true",
         "trainer.entropy_coef=0.01"]  # the weights move even when no sample is rewarded


def rl_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm")
    subprocess.run([sys.executable, str(ROOT / "examples" / "vlm" / "make_data.py"), "--count", "16", "--out",
                    str(out)], check=True, capture_output=True)
    return [f"data.path={out / 'data' / 'train.jsonl'}", f"model.path={out / 'tiny-qwen2.5-vl'}"], out


def test_a_bad_image_is_one_line_at_dry_run(task):
    paths, out = task
    rows = (out / "data" / "train.jsonl").read_text().splitlines()
    bad = out / "data" / "bad.jsonl"
    bad.write_text("\n".join([rows[0], rows[1].replace("images/1.png", "images/none.png")]) + "\n")
    result = rl_cli("run", str(CONFIG), "--dry-run", *paths, f"data.path={bad}")
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    assert f"{bad}:2: image not found: {out / 'data' / 'images' / 'none.png'}" in result.stderr + result.stdout


def test_a_step_then_a_resumed_step_and_export(task, tmp_path):
    paths, _ = task
    run = tmp_path / "run"
    first = rl_cli("run", str(CONFIG), "--run-dir", str(run), *paths, *SMALL, "rollout.num_rollouts=1")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    again = rl_cli("run", "--resume", str(run), "rollout.num_rollouts=2")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # steps count from 1
    assert all(r["train_rollout_logprob_abs_diff_max"] < 1e-5 for r in rows), [r["train_rollout_logprob_abs_diff_max"]
                                                                              for r in rows]
    assert rows[0]["train/ref_policy_logprob_abs_diff"] == 0.0 < rows[1]["train/ref_policy_logprob_abs_diff"]
    final = run / "hf-final"
    assert json.loads((final / "config.json").read_text())["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert (final / "preprocessor_config.json").is_file() and (final / "chat_template.jinja").is_file()
