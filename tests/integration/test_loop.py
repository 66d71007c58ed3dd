"""The loop end to end through `rl-cli run`: Megatron trainer on the CPU, a local engine behind the real
sglang-router, rewards, checkpoints. Small batches so each run takes seconds."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMALL = ["rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=32",
         "trainer.micro_batch_size=32", "rollout.check_weights=true"]  # every push read back from the engines
KEYS = {"step", "rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/entropy",
        "train/grad_norm", "perf/step_time", "perf/rollout_tokens_per_s", "train_rollout_logprob_abs_diff",
        "perf/time_generate", "perf/time_log_probs", "perf/time_train", "perf/time_sync"}


def rl_cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", *map(str, args)],
                          capture_output=True, text=True, timeout=600, **kwargs)


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def leftovers(run_dir, family=()):
    """Processes (engines, router) still running for this run directory, and those of ``family`` (a killed
    driver's descendants: checkpoint writers, multiprocessing managers and trackers) not yet gone."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found + [p for p in family if p not in found and alive(p)]


def alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def describe(procs):
    """Pid, parent, age and command line of each process, for an assertion message."""
    out = []
    for p in procs:
        try:
            wchan = Path(f"/proc/{p.pid}/wchan")  # where in the kernel it waits (futex: a lock)
            waits = wchan.read_text() if wchan.exists() else "?"
            out.append(f"pid {p.pid} (parent {p.ppid()}, {time.time() - p.create_time():.0f} s old, "
                       f"{p.num_threads()} threads, waits in {waits}): {' '.join(p.cmdline())[:300]}")
        except psutil.Error:
            pass
    return "; ".join(out)


def test_smoke_run_writes_the_run_directory(tmp_path):
    run = tmp_path / "run"
    out = rl_cli(QUICKSTART, "--smoke", "--run-dir", run, *SMALL, "trainer.log_kl=true")  # with the reference pass
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert KEYS <= set(rows[-1]), KEYS - set(rows[-1])
    assert rows[-1]["train_rollout_logprob_abs_diff"] < 1e-3, "engine and trainer must agree on log-probs"
    assert rows[-1]["rollout/samples"] == 32
    # the reference is the step-0 policy: identical log-probs before the first update
    assert rows[0]["train/ref_policy_logprob_abs_diff"] == 0.0
    for name in ("config.yaml", "plugins.json", "curves.png", "rollouts.jsonl"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert "done: 2 steps" in out.stdout
    assert not leftovers(run)


def test_kill_9_then_resume_loses_and_repeats_no_step(tmp_path):
    # 16 steps: killed after 3, so a poll that comes late (steps take ~0.1 s) still finds the run going
    args = [QUICKSTART, *SMALL, "rollout.num_rollouts=16", "checkpoint.interval=2"]
    reference = tmp_path / "reference"
    assert rl_cli(*args, "--run-dir", reference).returncode == 0
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "run", *map(str, args), "--run-dir", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(jsonl(run / "metrics.jsonl")) < 3 and time.monotonic() < deadline:  # steps 0-2 done, ckpt at 1
        time.sleep(0.2)
    family = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(jsonl(run / "metrics.jsonl")) < 16, "the run finished before it could be killed"
    deadline = time.monotonic() + 30
    while leftovers(run, family) and time.monotonic() < deadline:  # every child dies with its parent
        time.sleep(0.2)
    assert not leftovers(run, family), describe(leftovers(run, family))

    out = rl_cli("--resume", run)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert [r["step"] for r in jsonl(run / "metrics.jsonl")] == list(range(1, 17))
    served = [r["prompts"] for r in jsonl(run / "rollouts.jsonl")]
    assert served == [r["prompts"] for r in jsonl(reference / "rollouts.jsonl")], "data order changed"
    # the quickstart seeds its sampling: the resumed run draws the same responses and trains the same way
    assert jsonl(run / "rollouts.jsonl") == jsonl(reference / "rollouts.jsonl")
    for resumed, uninterrupted in zip(jsonl(run / "metrics.jsonl"), jsonl(reference / "metrics.jsonl")):
        assert resumed["rollout/reward_mean"] == uninterrupted["rollout/reward_mean"]
        assert resumed["train/loss"] == pytest.approx(uninterrupted["train/loss"], abs=1e-6)


def test_a_trainer_that_cannot_load_its_checkpoint_stops_the_engines_started_beside_it(tmp_path):
    """The engines start before the trainer builds (they wait for its checkpoint); a truncated ``model.path``
    makes the build fail: one line naming the file, exit code 2, and no engine left waiting."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "model", "qwen3")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    run = tmp_path / "run"
    out = rl_cli(QUICKSTART, "--run-dir", run, f"model.path={model}", "rollout.num_rollouts=1")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"{weights}: not a readable safetensors file" in out.stderr
    assert "the engines start beside it" in out.stdout
    deadline = time.monotonic() + 30
    while leftovers(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(run), describe(leftovers(run))


def test_ray_executor_runs_the_same_loop(tmp_path):
    """Same config, seeded sampling: the Ray executor draws the same responses and gets the same rewards
    and losses as the local one. The Ray run is colocated with its trainer offloaded (the trainer actor's state
    leaves and comes back through the actor handle), which changes none of it."""
    runs = {}
    for executor, more in (("ray", ["resources.colocate=true", "resources.offload_trainer=true"]), ("local", [])):
        run = tmp_path / executor
        out = rl_cli(QUICKSTART, "--smoke", "--run-dir", run, *SMALL, f"resources.executor={executor}", *more)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        runs[executor] = (jsonl(run / "metrics.jsonl"), jsonl(run / "rollouts.jsonl"))
    (ray_rows, ray_rollouts), (local_rows, local_rollouts) = runs["ray"], runs["local"]
    assert [r["step"] for r in ray_rows] == [1, 2] and ray_rows[-1]["train_rollout_logprob_abs_diff"] < 1e-3
    assert all(r["perf/trainer_offloaded_gib"] > 0 for r in ray_rows)
    assert ray_rollouts == local_rollouts  # prompts and sampled responses
    for a, b in zip(ray_rows, local_rows):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)


def test_failing_reward_is_counted_and_the_run_goes_on(tmp_path, write):
    plugin = write("flaky.py", '''
from dataclasses import dataclass
from posttrain import hookimpl

class Flaky:
    """Raises on one sample in ten."""
    name = "flaky"
    @dataclass
    class Config:
        pass
    def __init__(self, config=None):
        self.config = config
        self.calls = 0
    def __call__(self, sample):
        self.calls += 1
        if self.calls % 10 == 0:
            raise RuntimeError("reward server hiccup")
        return float(sample.response == sample.label)

@hookimpl
def posttrain_register_rewards(registry):
    registry.add(Flaky)
''')
    run = tmp_path / "flaky"
    out = rl_cli(QUICKSTART, "--smoke", "--run-dir", run, *SMALL, "rewards=[{name: flaky}]", "--plugin", plugin)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = jsonl(run / "metrics.jsonl")
    failed = sum(r["reward/failed"] for r in rows)
    assert 3 <= failed <= 10, failed  # 64 samples, one in ten raises
    assert all(r["rollout/samples"] == 32 - r["reward/failed"] for r in rows)


def test_killed_engine_is_restarted_and_the_run_continues(tmp_path):
    """kill -9 one of two engines mid-run: its requests are resent to the other through the router, the
    run goes on, and the dead engine is restarted (and gets the weights) at the next push."""
    run = tmp_path / "fleet"
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "run", str(QUICKSTART), *SMALL,
                             "rollout.num_rollouts=8", "rollout.max_new_tokens=64", "resources.num_engines=2",
                             "rollout.use_router=true", "rollout.engine.context_length=128",
                             "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(jsonl(run / "metrics.jsonl")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    engines = [p for p in leftovers(run) if "serve" in p.cmdline()]
    assert len(engines) == 2
    cmd = engines[0].cmdline()
    key = engines[0].environ()["POSTTRAIN_ENGINE_API_KEY"]  # the run's key: readable by its own uid only
    info = urllib.request.Request(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}/get_server_info",
                                  headers={"Authorization": f"Bearer {key}"})
    while time.monotonic() < deadline:  # mid-rollout: kill it while it holds requests
        with urllib.request.urlopen(info, timeout=10) as resp:
            if json.loads(resp.read())["internal_states"][0]["num_requests"]:
                break
        time.sleep(0.01)
    engines[0].kill()
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    rows = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert sum(r["perf/engine_restarts"] for r in rows) == 1
    assert all(r["rollout/samples"] == 32 for r in rows)
    assert max(r["perf/step_time"] for r in rows) < 60, "a request waited on the dead engine"


def test_bad_batch_identity_is_refused_before_anything_starts(tmp_path):
    run = tmp_path / "never"
    out = rl_cli(QUICKSTART, "--run-dir", run, "trainer.global_batch_size=512", "trainer.micro_batch_size=512")
    assert out.returncode == 2 and "batch identity violated" in out.stderr
    assert not run.exists()


def test_async_mode_trains_one_step_off_policy(tmp_path):
    run = tmp_path / "async"
    out = rl_cli(QUICKSTART, "--run-dir", run, *SMALL, "rollout.num_rollouts=3", "rollout.mode=async")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # step N+1 was generated while step N trained, with the weights from before step N
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]


def test_colocated_run_releases_engine_memory_and_syncs_by_tensor(tmp_path):
    """``resources.colocate``: the engine releases its memory for the trainer's turn, takes it back for
    the next generation, and the weights travel by ``/update_weights_from_tensor`` (by value on a CPU, where
    ``auto`` picks Gloo: set here, as GPU runs have it).
    ``resources.offload_trainer`` (the second run): the trainer's state waits in host memory while the engine
    generates (on a CPU it is copied into other host memory, its storages freed all the same) and the seeded run
    is the same step for step; the checkpoint is saved before the offload, the final export after it."""
    runs = {}
    for name, extra in (("colocated", []), ("offloaded", ["resources.offload_trainer=true", "checkpoint.interval=2"])):
        run = tmp_path / name
        out = rl_cli(QUICKSTART, "--run-dir", run, *SMALL, "rollout.num_rollouts=3", "resources.colocate=true",
                     "rollout.weight_sync=tensor", *extra)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        runs[name] = rows = jsonl(run / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all("perf/time_release" in r for r in rows)
        # the pushed weights reached the engine: what it sampled with agrees with the trainer at every step
        assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 1e-3
        assert [r["rollout/staleness_max"] for r in rows] == [0.0, 0.0, 0.0]
    plain, offloaded = runs["colocated"], runs["offloaded"]
    assert [r["train/loss"] for r in offloaded] == [r["train/loss"] for r in plain]
    assert [r["rollout/reward_mean"] for r in offloaded] == [r["rollout/reward_mean"] for r in plain]
    assert all(r["perf/trainer_offloaded_gib"] > 0 and "perf/time_onload" in r for r in offloaded)
    assert not any("perf/trainer_offloaded_gib" in r or "perf/time_onload" in r for r in plain)
    assert sorted(p.name for p in (tmp_path / "offloaded" / "checkpoints").glob("step_*")) == ["step_000002",
                                                                                          "step_000003"]
    assert (tmp_path / "offloaded" / "hf-final" / "config.json").exists()


def test_kl_as_loss_term_and_in_the_reward(tmp_path, write):
    # a reward that splits random responses about evenly, so the first step surely moves the weights
    plugin = write("parity.py", '''
from dataclasses import dataclass
from posttrain import hookimpl

class Parity:
    """1.0 when the response's first character has an odd code point."""
    name = "parity"
    @dataclass
    class Config:
        pass
    def __init__(self, config=None):
        self.config = config
    def __call__(self, sample):
        return float(bool(sample.response) and ord(sample.response[0]) % 2 == 1)

@hookimpl
def posttrain_register_rewards(registry):
    registry.add(Parity)
''')
    run = tmp_path / "kl"
    out = rl_cli(QUICKSTART, "--smoke", "--run-dir", run, *SMALL, "trainer.kl_loss_coef=0.01",
                 "trainer.kl_in_reward_coef=0.05", "trainer.kl_kind=k2", "estimator=reinforce_plus_plus",
                 "rewards=[{name: parity}]", "--plugin", plugin)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = jsonl(run / "metrics.jsonl")
    assert rows[0]["train/kl"] == 0.0  # the policy is the reference before the first update
    assert rows[-1]["train/kl"] > 0  # and has moved away from it after
    assert rows[0]["train/ref_policy_logprob_abs_diff"] == 0.0 < rows[-1]["train/ref_policy_logprob_abs_diff"]


def test_a_train_pass_out_of_gpu_memory_ends_the_run_with_one_line_naming_the_keys(tmp_path, monkeypatch, capsys):
    """PyTorch's out-of-memory error in a trainer pass (raised here by the train step, as a GPU would) ends
    ``rl-cli run`` with exit code 1 and one line: what it tried to allocate, the keys that make the pass smaller with
    their values, and how to resume. No traceback, and the engines it started are stopped."""
    from posttrain.cli.main import main
    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of "
                                     "79.19 GiB of which 1.20 GiB is free.")
    monkeypatch.setattr(MegatronTrainer, "train_step", out_of_memory)
    run = tmp_path / "oom"
    monkeypatch.setattr(sys, "argv", ["rl-cli", "run", str(QUICKSTART), "--run-dir", str(run), *SMALL,
                                      "trainer.max_tokens_per_micro_batch=4096"])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("error: trainer: out of GPU memory in the train pass (tried to allocate 2.32 GiB)")
    assert "take less: trainer.max_tokens_per_micro_batch (4096), trainer.backend.log_probs_chunk_size" in lines[0]
    assert "trainer.backend.log_probs_chunk_size (" in lines[0] and "--resume RUN_DIR" in lines[0]
    assert jsonl(run / "metrics.jsonl") == []  # step 0 never finished
    deadline = time.monotonic() + 30
    while leftovers(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(run)
