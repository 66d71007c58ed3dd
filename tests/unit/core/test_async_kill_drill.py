"""The kill -9 drill of fully-async checkpoints: 10 kills at random moments, each followed by a resume.

A run here is a process (this file as a script) that drives the real parts a fully-async run checkpoints
with: the data buffer, :class:`FullyAsyncRollout` (queue, producer, staleness bound), the run directory's
atomic checkpoints and its ``rollouts.jsonl``. The rollout and the train step are short sleeps (no engine
or trainer: a real `rl-cli` start-up costs 20-60 s on 2 cores; one real kill and resume is in
tests/integration/test_fully_async.py). The loop's order is kept: take a batch, log it, train, push,
checkpoint (queue, prompts in flight and data position in one instant).
"""

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
PROMPTS = [SimpleNamespace(prompt=f"p{i}", label=str(i), metadata={}) for i in range(16)]
EPOCHS, BATCH = 3, 2
STEPS = len(PROMPTS) * EPOCHS // BATCH  # 24: every prompt exactly EPOCHS times


class NoEngines:
    continued = 0

    @asynccontextmanager
    async def paused(self):
        yield


async def run(path: str, seed: int) -> None:
    from posttrain.core.async_rollout import FullyAsyncRollout
    from posttrain.core.buffer import DataBuffer
    from posttrain.core.run_dir import RunDirectory
    from posttrain.core.types import SampleStatus

    rng = random.Random(seed)
    run = RunDirectory(path)
    run.path.mkdir(parents=True, exist_ok=True)
    buf = DataBuffer(PROMPTS, 1, seed=0, epochs=EPOCHS)
    ckpt, state, done = run.latest_checkpoint(), {}, 0  # steps done
    if ckpt is not None:
        state = run.load_checkpoint(ckpt)
        buf.load_state_dict(state["buffer"])
        done = state["steps"]
    run.truncate_after(done)
    box = {}

    async def rollout(group):
        v0 = box["f"].version
        await asyncio.sleep(rng.uniform(0, 0.03))
        for s in group:
            s.tokens, s.response_length, s.reward, s.status = [1, 2], 1, 1.0, SampleStatus.COMPLETED
            s.weight_version, s.weight_versions = box["f"].version, [v0]
        return group

    feeder = box["f"] = FullyAsyncRollout(buf, rollout, NoEngines(), BATCH, max_staleness=2, start=done)
    feeder.load_state_dict(state.get("fully_async", {}))
    feeder.start()
    for step in range(done, STEPS):  # 0-based indices; logged from 1
        groups, metrics = await feeder.next_batch(step)
        assert metrics["rollout/staleness_max"] <= 2
        run.log_rollouts(step + 1, groups, [])
        await asyncio.sleep(rng.uniform(0.02, 0.08))  # the train step; generation goes on meanwhile
        await feeder.push(lambda: time.sleep(0.005), step + 1)
        run.save_checkpoint(step + 1, lambda d: Path(d).mkdir(), {"buffer": buf.state_dict(),
                                                                  "fully_async": feeder.state_dict()}, keep=2)
    await feeder.close()


def rollouts(path: Path) -> list[dict]:
    f = path / "rollouts.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def test_ten_kills_at_random_moments_lose_and_repeat_nothing(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "run"
    cmd = [sys.executable, "-m", "tests.unit.core.test_async_kill_drill", str(path)]
    kills, resumed_with = 0, []
    deadline = time.monotonic() + 240
    while kills < 10 and time.monotonic() < deadline:
        ckpt = path / "checkpoints" / "latest"
        if ckpt.is_file():  # what this resume starts from: groups finished and in flight at the checkpoint
            saved = json.loads((path / "checkpoints" / ckpt.read_text() / "state.json").read_text())["fully_async"]
            resumed_with.append(len(saved["queue"]) + len(saved["in_flight"]))
        before = len(rollouts(path))
        proc = subprocess.Popen([*cmd, str(kills)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        while len(rollouts(path)) <= before and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.12))  # mid-step, mid-push or mid-checkpoint
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before kill {kills + 1}: {proc.stderr.read().decode()[-2000:]}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills == 10
    out = subprocess.run([*cmd, "99"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = rollouts(path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no step repeated or skipped
    assert Counter(p for r in rows for p in r["prompts"]) == {p.prompt: EPOCHS for p in PROMPTS}
    assert sum(n > 0 for n in resumed_with) >= 5  # resumes did carry queued or in-flight groups


if __name__ == "__main__":
    asyncio.run(run(sys.argv[1], int(sys.argv[2])))
