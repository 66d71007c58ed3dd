"""The driver under the fault probe's cases, through `rl-cli run`: a step with no trainable sample, two
writers of one run directory, resume with another model, and `--resume RUN key=val`."""

import subprocess
import sys
import time

import pytest

from tests.integration.test_loop import QUICKSTART, SMALL, jsonl, rl_cli

pytestmark = pytest.mark.slow

NAN_REWARD = '''
from dataclasses import dataclass
from posttrain import hookimpl

class NanScore:
    """Every score is NaN: every sample's reward fails."""
    name = "nan_score"
    @dataclass
    class Config:
        pass
    def __init__(self, config=None):
        self.config = config
    def __call__(self, sample):
        return float("nan")

@hookimpl
def posttrain_register_rewards(registry):
    registry.add(NanScore)
'''


def test_empty_steps_lock_resume_model_check_and_resume_overrides(tmp_path, write):
    plugin = write("nan_score.py", NAN_REWARD)
    run = tmp_path / "empty"
    args = ["--plugin", plugin, "rewards=[{name: nan_score}]"]
    out = rl_cli(QUICKSTART, "--smoke", "--run-dir", run, *SMALL, *args, "checkpoint.interval=1")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["rollout/empty_steps"] for r in rows] == [1.0, 2.0] and all(r["rollout/samples"] == 0 for r in rows)
    assert all(r["reward/failed"] == 32 for r in rows)
    assert "no trainable sample" in out.stderr

    # another model: refused before any engine starts, naming what changed
    other = rl_cli("--resume", run, "model.name=llama3", *args)
    assert other.returncode == 2, other.stdout[-2000:] + other.stderr[-3000:]
    assert "holds another model than the config: model.name: 'qwen3' -> 'llama3'" in other.stderr

    # --resume RUN key=val: the override holds (one more step), and the change is named
    resumed = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "run", "--resume", str(run),
                                "rollout.num_rollouts=3", *map(str, args)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = run / ".lock"
    deadline = time.monotonic() + 120
    while (not lock.exists() or lock.read_text() != str(resumed.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = rl_cli("--resume", run, *args)  # a second writer while the first holds the directory
    assert second.returncode == 2 and f"in use by another process (PID {resumed.pid})" in second.stderr
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "config changed since step_000002: rollout.num_rollouts: 2 -> 3" in stderr
    assert [r["step"] for r in jsonl(run / "metrics.jsonl")] == [1, 2, 3]
