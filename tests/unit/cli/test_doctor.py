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


@pytest.mark.parametrize("offload, gpu_gib, host_gib, kl", [
    (False, 27.0, 100.0, True), (True, 27.0, 100.0, True), (True, 29.0, 1.0, True), (True, 29.0, 100.0, True),
    ("[optimizer, grads]", 29.0, 100.0, True), ("[optimizer, grads]", 29.0, 20.0, True), (True, 29.0, 23.0, False),
    (True, 29.0, 22.0, False)])
def test_an_offloaded_colocated_trainer_needs_both_sides_on_the_gpu_and_its_state_in_host_memory(monkeypatch, offload,
                                                                                             gpu_gib, host_gib, kl):
    """Colocated on one GPU, the trainer's state and the engine's weights meet at each weight update, offloaded
    or not (a 1.7B model: 25.3 GiB of training state, 3.2 GiB of engine weights); with the offload the host also
    holds the trainer's state: 16 bytes a parameter (bf16 weights and reference, fp32 masters, Adam's moments), 14
    for a run that keeps no reference (no KL term, no ``log_kl``), or 12 offloading only the optimizer's state and the
    gradients (``offload_parts``). The GPU and host are stand-ins: CI has no GPU."""
    import types

    import psutil
    import torch

    from posttrain.cli.doctor import GIB, check_placement
    from posttrain.core.config import load_config
    from posttrain.core.plugins import load_plugins

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda gpu: (int(gpu_gib * GIB), int(141 * GIB)))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=int(host_gib * GIB)))
    plugins = load_plugins()
    parts = [f"trainer.backend.offload_parts={offload}"] if isinstance(offload, str) else []
    cfg = load_config(QUICKSTART, ["resources.colocate=true", f"resources.offload_trainer={str(bool(offload)).lower()}",
                                   "resources.trainer_gpus_per_node=1", "rollout.engine.device=cuda",
                                   "model.dtype=bfloat16", f"trainer.log_kl={str(kl).lower()}", *parts], plugins=plugins)
    found = {f.area: f for f in check_placement(cfg, plugins, 1_700_000_000)}
    gpu = found["gpu 0 memory"]
    assert gpu.ok is (gpu_gib > 28.5) and gpu.message.endswith("needs at least 28.5 GiB")
    if offload:
        want = 19.0 if parts else 25.3 if kl else 22.2
        assert found["host memory"].ok is (host_gib > want)
        assert found["host memory"].message.endswith(f"the offloaded trainer state needs at least {want} GiB")
    else:
        assert "host memory" not in found


PLUGIN_CHECK = '''
from posttrain import hookimpl
from posttrain.core.interfaces import Finding


@hookimpl
def posttrain_doctor_checks(run):
    return [Finding(False, "licence server", f"unreachable for {len(run.rewards)} reward(s)")]
'''


def test_plugins_add_their_checks_through_the_hook(tmp_path):
    """``posttrain_doctor_checks``: a plugin's findings join doctor's own; the code reward's sandbox check is one."""
    from posttrain.cli.doctor import plugin_checks
    from posttrain.core.config import load_config
    from posttrain.core.plugins import load_plugins

    (tmp_path / "licence.py").write_text(PLUGIN_CHECK)
    plugins = load_plugins(plugin_files=[tmp_path / "licence.py"])
    cfg = load_config(QUICKSTART, [], plugins=plugins)
    lines = {f.line() for f in plugin_checks(cfg, plugins)}
    assert f"FAIL licence server: unreachable for {len(cfg.rewards)} reward(s)" in lines
    assert any(line.startswith("note sandbox: bwrap") and "no reward here needs it" in line for line in lines), lines
