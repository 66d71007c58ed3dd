"""The trainer as a group of ranks through `rl-cli run`: DP, TP and PP layouts (local child processes, Ray
actors, two Ray nodes) take the same steps as one rank; a checkpoint resumes in another layout; a killed
rank ends the run with one line and `--resume` continues. The quickstart seeds its sampling, so every
layout draws the same samples as the one-rank run, and step 1's samples show that the weights pushed
from the group are the one-rank run's."""

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from tests.integration.test_loop import QUICKSTART, jsonl, leftovers, rl_cli

pytestmark = pytest.mark.slow
STEPS = ["rollout.num_rollouts=3", "trainer.backend.sequence_packing=true",  # PP needs packing: every run packs
         "trainer.log_kl=true"]  # the reference pass runs under every layout too


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The reference: the quickstart's first 3 steps on one rank (in the driver)."""
    run = tmp_path_factory.mktemp("one-rank") / "run"
    out = rl_cli(QUICKSTART, *STEPS, "--run-dir", run)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return run


def assert_same_steps(run, reference):
    rows, ref = jsonl(run / "metrics.jsonl"), jsonl(reference / "metrics.jsonl")
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == [1, 2, 3]
    assert jsonl(run / "rollouts.jsonl") == jsonl(reference / "rollouts.jsonl"), "other samples were drawn"
    for got, want in zip(rows, ref):
        assert got["rollout/reward_mean"] == want["rollout/reward_mean"]
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5, abs=1e-7)
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
        assert got["train/kl"] == pytest.approx(want["train/kl"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("layout", [
    ["resources.trainer_procs_per_node=2", "trainer.backend.pp=2"],  # PP=2: one layer per stage, 1F1B
    ["resources.trainer_procs_per_node=4", "trainer.backend.tp=2"],  # DP=2 x TP=2
    # colocated, every rank's state to host memory and back each step (resources.offload_trainer)
    ["resources.trainer_procs_per_node=2", "trainer.backend.pp=2", "resources.colocate=true",
     "resources.offload_trainer=true"],
], ids=["pp2", "dp2xtp2", "pp2_colocated_offloaded"])
def test_layouts_take_the_one_rank_steps(tmp_path, one_rank, layout):
    run = tmp_path / "run"
    out = rl_cli(QUICKSTART, *STEPS, *layout, "--run-dir", run)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert_same_steps(run, one_rank)
    if "resources.offload_trainer=true" in layout:  # rank 0's share left its device after every push
        assert all(r["perf/trainer_offloaded_gib"] > 0 for r in jsonl(run / "metrics.jsonl"))
    assert sorted(p.name for p in (run / "logs").glob("trainer-rank*.log")) == \
        [f"trainer-rank{r}.log" for r in range(int(layout[0][-1]))]
    assert not leftovers(run)


def _rank_process(run, rank):
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if "trainer_rank" in cmdline and f"{run}/logs/trainer-rank{rank}.log" in cmdline:
            return p
    return None


def test_resume_across_layouts_after_a_killed_rank(tmp_path, one_rank):
    """Step 0 at DP=2 (checkpoint), step 1 resumed at TP=2 (DP 2 -> 1) until rank 1 is killed with -9
    after its checkpoint, then step 2 resumed on one rank (TP 2 -> 1): the one-rank run's steps."""
    run = tmp_path / "run"
    every = ["checkpoint.interval=1"]
    out = rl_cli(QUICKSTART, *STEPS, *every, "rollout.num_rollouts=1", "resources.trainer_procs_per_node=2",
                 "--run-dir", run)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "run", "--resume", str(run),
                             "rollout.num_rollouts=3", "resources.trainer_procs_per_node=2", "trainer.backend.tp=2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    latest = run / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not (latest.exists() and latest.read_text() == "step_000002") and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    victim = _rank_process(run, 1)
    assert victim is not None, "no trainer rank 1 process"
    victim.kill()
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert time.monotonic() - killed_at < 60, "the run took too long to notice the dead rank"
    assert f"error: trainer rank 1 of 2 was killed by SIGKILL; its log: {run}/logs/trainer-rank1.log" in err
    assert "Traceback" not in err
    assert len(jsonl(run / "metrics.jsonl")) == 2, "the killed run must not have finished step 2"
    deadline = time.monotonic() + 30
    while leftovers(run) and time.monotonic() < deadline:  # ranks, engines and router are stopped
        time.sleep(0.2)
    assert not leftovers(run)

    out = rl_cli("--resume", run, "rollout.num_rollouts=3", "resources.trainer_procs_per_node=1", "trainer.backend.tp=1")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert_same_steps(run, one_rank)


def test_ray_placement_group_of_ranks(tmp_path, one_rank):
    """Under Ray: one actor per rank on a placement group, TP=2 across the two ranks; the engines' actor starts
    before the ranks build (its server waits for their checkpoint)."""
    run = tmp_path / "run"
    out = rl_cli(QUICKSTART, *STEPS, "resources.executor=ray", "resources.trainer_procs_per_node=2",
                 "trainer.backend.tp=2", "--run-dir", run)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "the engines start beside it" in out.stdout
    assert_same_steps(run, one_rank)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_node_ray_cluster():
    """A Ray cluster of two nodes on this machine (`ray start --head` and a second `ray start --address`,
    each with its own CPUs and a custom resource), with its own token and temp dir so no other Ray user
    of the machine sees it; its processes are stopped by id afterwards. Yields (address, env)."""
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--disable-usage-stats", "--node-ip-address",
           "127.0.0.1", "--dashboard-agent-listen-port", str(_free_port())]
    try:
        subprocess.run([*ray, "--head", "--port", str(port), "--num-cpus", "2", "--resources", '{"node_a": 1}',
                        "--temp-dir", temp, "--include-dashboard", "false", "--dashboard-port", str(_free_port()),
                        "--ray-client-server-port", str(_free_port())], env=env, check=True, capture_output=True,
                       timeout=300)
        subprocess.run([*ray, "--address", f"127.0.0.1:{port}", "--num-cpus", "2", "--resources", '{"node_b": 1}'],
                       env=env, check=True, capture_output=True, timeout=300)
        yield f"127.0.0.1:{port}", env
    finally:
        mine = re.compile(rf"{re.escape(temp)}|:{port}\b")
        procs = [p for p in psutil.process_iter(["cmdline"]) if mine.search(" ".join(p.info["cmdline"] or []))]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            p.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_two_node_ray_cluster(tmp_path, one_rank, two_node_ray_cluster):
    """trainer_nodes: 2 on a two-node cluster: a rank per node (Gloo across "nodes", the rendezvous on rank
    0's node), DP=2, the one-rank run's steps."""
    address, env = two_node_ray_cluster
    run = tmp_path / "run"
    out = rl_cli(QUICKSTART, *STEPS, "resources.executor=ray", f"resources.ray_address={address}",
                 "resources.trainer_nodes=2", "--run-dir", run, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert_same_steps(run, one_rank)
    nodes = [re.search(r"on Ray node (\w+)", (run / "logs" / f"trainer-rank{r}.log").read_text()).group(1)
             for r in range(2)]
    assert nodes[0] != nodes[1], "the placement group put both ranks on one node"
