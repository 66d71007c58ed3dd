"""The multi-stage examples from a clean checkout, every stage for two steps (``SMOKE=1``): SFT -> GRPO
from its HF export, and on-policy distillation with the quickstart run as the teacher fleet."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.test_loop import jsonl, leftovers

pytestmark = pytest.mark.slow


def _run(script: str, runs: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, SMOKE="1", RUNS=str(runs), PYTHON=sys.executable,
               RL_CLI=str(Path(sys.executable).with_name("rl-cli")))
    return subprocess.run(["bash", str(ROOT / "examples" / script / "run.sh")], env=env, capture_output=True,
                          text=True, timeout=900)


def test_sft_then_rl_chains_through_the_hf_export(tmp_path):
    out = _run("sft-then-rl", tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert [r["step"] for r in jsonl(tmp_path / "sft" / "metrics.jsonl")] == [1, 2]
    rl = jsonl(tmp_path / "rl" / "metrics.jsonl")
    assert [r["step"] for r in rl] == [1, 2] and rl[0]["train_rollout_logprob_abs_diff"] < 1e-3
    config = (tmp_path / "rl" / "config.yaml").read_text()
    assert f"path: {tmp_path / 'sft' / 'hf-final'}" in config  # the RL stage started from the SFT weights
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["bench"] == "steps_to_reward" and line["steps"] == 2


def test_distill_scores_every_sample_with_the_teacher_fleet(tmp_path):
    out = _run("distill", tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    student = jsonl(tmp_path / "student" / "metrics.jsonl")
    assert [r["step"] for r in student] == [1, 2]
    # the teacher (the quickstart after 2 steps) and the fresh student disagree: a nonzero reverse KL
    assert all(r["estimator/reverse_kl"] != 0 and r["estimator/teacher_log_prob"] < 0 for r in student)
    assert (tmp_path / "student" / "logs" / "teacher" / "engine-0.log").exists()
    assert "engine step failed" not in (tmp_path / "student" / "logs" / "teacher" / "engine-0.log").read_text()
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["bench"] == "distill" and line["steps"] == 2
    assert not leftovers(tmp_path)
