"""Drill: a hang planted in each kind of wait of a quickstart-sized `rl-cli run`; the watchdog must end the run
with one line and a stall report that names the hung thing.

The hangs, each planted at a fixed point of the run by the ``drill`` plugin below (no guessed moments):

- weight push: step 1's reward SIGSTOPs the engine (after the step's only group generated), so the push after
  step 1's training meets it;
- engine: after step 1 (``posttrain_on_step_end``) the engine is SIGSTOPped, so step 2's /generate hangs;
- reward: the reward sleeps forever (a sync reward in the driver: it blocks the event loop itself);
- trainer rank: after step 1, rank 1 of a 2-rank trainer group is SIGSTOPped, so rank 0 waits in a collective.
"""

import os
import re

import psutil
import pytest

from tests.integration.test_loop import QUICKSTART, leftovers, rl_cli

pytestmark = pytest.mark.slow

DRILL = '''
import os, signal, time
from dataclasses import dataclass

import psutil
from posttrain import hookimpl

KIND = os.environ.get("WATCHDOG_DRILL", "")


def stop(marker):
    for child in psutil.Process().children(recursive=True):
        if marker in " ".join(child.cmdline()):
            child.send_signal(signal.SIGSTOP)
            return
    raise RuntimeError(f"drill: no process with {marker!r}")


class Drill:
    """Scores exact matches; plants the reward and weight-push hangs."""
    name = "drill"
    @dataclass
    class Config:
        pass
    def __init__(self, config=None):
        self.calls = 0
    def __call__(self, sample):
        self.calls += 1
        if KIND == "reward":
            time.sleep(3600)
        if KIND == "weight_push" and self.calls == 1:
            stop("engine serve")
        return float(sample.response == sample.label)


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(Drill)


@hookimpl
def posttrain_on_step_end(step, metrics):
    if step == 1 and KIND == "engine":
        stop("engine serve")
    if step == 1 and KIND == "trainer_rank":
        stop("trainer-rank1.log")
'''

ARGS = ["rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=32",
        "trainer.micro_batch_size=32", "rollout.num_rollouts=3", "rewards=[{name: drill}]", "watchdog.stall_s=5",
        "watchdog.startup_stall_s=300", "watchdog.exit_grace_s=5"]


def drill(tmp_path, write, kind, *more):
    plugin = write("drill.py", DRILL)
    run = tmp_path / kind
    try:
        out = rl_cli(QUICKSTART, "--run-dir", run, *ARGS, *more, "--plugin", plugin,
                     env={**os.environ, "WATCHDOG_DRILL": kind})
    finally:
        for p in leftovers(run):  # a stopped process would outlive a failed test
            try:
                p.kill()
            except psutil.Error:
                pass
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    report = run / "stall-report.txt"
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) >= 1 and lines[0].startswith("error: stalled: no progress for "), out.stderr[-3000:]
    assert f"report: {report}" in out.stderr and f"rl-cli run --resume {run}" in out.stderr
    assert "Traceback" not in out.stderr
    text = report.read_text()
    oldest = text.split("oldest first) ==\n")[1].splitlines()[0]
    assert "--- thread MainThread ---" in text, "the driver's stacks"
    return lines[0], oldest, text


def test_hung_weight_push(tmp_path, write):
    # one group: its generation is over before its first reward stops the engine
    line, oldest, text = drill(tmp_path, write, "weight_push", "rollout.rollout_batch_size=1",
                               "rollout.n_samples_per_prompt=32")
    assert "waiting on weight_push weight push of version 1 to http://" in line
    assert oldest.startswith("  weight_push weight push of version 1 to http://")
    url = re.search(r"to (http://\S+?)[ ,]", oldest).group(1)
    assert f"engine {url} pid" in text and re.search(rf"engine {re.escape(url)} pid \d+: stopped", text)
    assert "in push_weights" in text, "the driver's stack shows the push"


def test_hung_engine(tmp_path, write):
    line, oldest, text = drill(tmp_path, write, "engine")
    match = re.match(r"  engine POST (http://[\d.:]+)/generate", oldest)
    assert match, oldest
    url = match.group(1)
    assert f"waiting on engine POST {url}/generate" in line
    assert re.search(rf"engine {re.escape(url)} pid \d+: stopped", text)
    assert f"engine {url}: did not answer /get_server_info" in text


def test_hung_reward(tmp_path, write):
    line, oldest, text = drill(tmp_path, write, "reward")
    assert "waiting on reward drill" in line and oldest.startswith("  reward drill (")
    assert "in __call__" in text and "time.sleep(3600)" in text, "the driver's stack shows the reward"
    assert "exiting now" not in line, "the run shut down by itself"


def test_hung_trainer_rank(tmp_path, write):
    line, oldest, text = drill(tmp_path, write, "trainer_rank", "resources.trainer_procs_per_node=2")
    assert oldest.startswith("  trainer_rank "), oldest
    assert "have not answered" in oldest
    assert re.search(r"trainer rank 1 pid \d+: stopped", text)
    assert re.search(r"trainer rank 0 pid \d+: \w+; stacks \(SIGUSR1\) go to .*trainer-rank0\.log", text)
