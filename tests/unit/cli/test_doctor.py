"""`rl-cli doctor`: the quickstart passes here; planted problems are named, one line each, exit 2."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", "doctor", str(QUICKSTART), *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_quickstart_passes_here_one_line_per_finding():
    out = doctor()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert all(line.split(" ", 1)[0] in ("ok", "note") for line in lines[:-1]), lines
    for needle in ("ok   config:", "ok   gpus: none needed", "ok   version megatron-core: 0.16.1",
                   "ok   version sglang-router: 0.3.2", "ok   ports:", "ok   disk:", "ok   memory:"):
        assert any(line.startswith(needle) for line in lines), (needle, lines)
    assert lines[-1].endswith(", 0 failed")


def test_planted_problems_are_named():
    gpus = doctor("resources.trainer_gpus_per_node=1", "rollout.engine.device=cuda")
    assert gpus.returncode == 2
    assert "FAIL gpus: the placement needs 2 GPU(s) (trainer 1, engines on [1]), this machine has 0" in gpus.stdout
    bad = doctor("rollout.temperature=1e-300", "rewards=[{name: code}]", "trainer.lr=.nan")
    assert bad.returncode == 2
    assert "FAIL config: rollout.temperature: 1e-300 is out of range" in bad.stdout
    assert "FAIL config: trainer.lr: expected a finite number" in bad.stdout
    sandbox = doctor("rewards=[{name: code}]", "checkpoint.interval=1", "checkpoint.keep=1000000000")
    assert sandbox.returncode == 2 and "FAIL disk:" in sandbox.stdout  # a billion checkpoints do not fit
    assert ("ok   sandbox: bwrap works" in sandbox.stdout) or ("FAIL sandbox:" in sandbox.stdout)


@pytest.mark.slow
def test_engines_get_a_weight_round_trip():
    out = doctor("--engines", "rollout.use_router=true")  # the quickstart runs its one engine without one
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok   engines: 1 started behind the router" in out.stdout
    assert "weight round trip by distributed: 25 tensors pushed" in out.stdout and "read back equal" in out.stdout
    disk = doctor("--engines", "rollout.weight_sync=disk", "rollout.use_router=false")
    assert disk.returncode == 0 and "weight round trip by disk" in disk.stdout, disk.stdout + disk.stderr
