"""``rollout.mode: fully_async`` end to end through `rl-cli run` (Megatron on the CPU, a local engine behind
sglang-router): the same run as sync mode with ``max_staleness: 0``, and kill -9 then resume with groups
queued and in flight."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from tests.integration.test_loop import QUICKSTART, SMALL, descendants, describe, jsonl, leftovers, rl_cli

pytestmark = pytest.mark.slow
FULLY = ["rollout.mode=fully_async", "rollout.partial=true"]


def test_max_staleness_0_gives_the_samples_and_losses_of_sync_mode(tmp_path):
    runs = {}
    for name, extra in (("sync", []), ("fully", [*FULLY, "rollout.max_staleness=0", "correction=null"])):
        run = tmp_path / name
        out = rl_cli(QUICKSTART, "--run-dir", run, *SMALL, "rollout.num_rollouts=3", *extra)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        runs[name] = (jsonl(run / "metrics.jsonl"), jsonl(run / "rollouts.jsonl"))
    (sync_rows, sync_rollouts), (rows, rollouts) = runs["sync"], runs["fully"]
    assert rollouts == sync_rollouts  # the prompts of every step and the sampled responses
    assert [r["step"] for r in rows] == [1, 2, 3]
    for a, b in zip(rows, sync_rows):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
        assert a["rollout/staleness_max"] == 0 and a["rollout/dropped_stale"] == 0


def test_kill_9_then_resume_trains_every_prompt_once_per_epoch(tmp_path, write):
    """12 prompts, 2 epochs, 4 groups a step: 6 steps train every prompt exactly twice. Killed with finished
    groups queued (k = 2 lets the producer run two steps ahead), resumed from the last checkpoint."""
    rows = [{"prompt": f"{i % 10}+{i // 10}=", "label": str((i % 10 + i // 10) % 10)} for i in range(12)]
    data = write("prompts.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    args = [QUICKSTART, f"data.path={data}", "data.epochs=2", "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=16", "trainer.micro_batch_size=16",
            "rollout.num_rollouts=6", "checkpoint.interval=1", *FULLY, "rollout.max_staleness=2",
            "eval.interval=3", f"eval.datasets=[{{name: held, path: {data}, limit: 4}}]"]
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "run", *map(str, args), "--run-dir", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(jsonl(run / "metrics.jsonl")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.uniform(0, 0.3))
    family = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(jsonl(run / "metrics.jsonl")) < 6, "the run finished before it could be killed"
    deadline = time.monotonic() + 30
    while leftovers(run, family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(run, family), describe(leftovers(run, family))
    state = json.loads((run / "checkpoints" / (run / "checkpoints" / "latest").read_text() / "state.json").read_text())
    saved = state["fully_async"]
    assert saved["queue"] or saved["in_flight"], "nothing was queued or in flight at the checkpoint"

    out = rl_cli("--resume", run)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["rollout/staleness_max"] <= 2 for r in rows)
    # eval at its interval, on the weights the step just pushed, while the producer kept generating
    evals = [(r["step"], r["eval/held/weight_version"]) for r in rows if "eval/held/weight_version" in r]
    assert evals == [(3, 3), (6, 6)]  # step N evaluates the weights it pushed, version N
    served = [r["step"] for r in jsonl(run / "rollouts.jsonl")]
    assert served == list(range(1, 7))
    trained = Counter(p for r in jsonl(run / "rollouts.jsonl") for p in r["prompts"])
    assert trained == {json.loads(line)["prompt"]: 2 for line in data.read_text().splitlines()}
