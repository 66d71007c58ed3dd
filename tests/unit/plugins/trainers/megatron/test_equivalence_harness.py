"""The CPU/GPU equivalence harness (tests/gpu/equivalence.py) on the CPU alone, as CI runs it: its
tolerances hold for an equivalent computation and catch a different one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

SCRIPT = ROOT / "tests" / "gpu" / "equivalence.py"


def _harness():
    spec = importlib.util.spec_from_file_location("equivalence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, name: str, steps: int, *sets: str):
    out = tmp_path / f"{name}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), "--steps", str(steps),
                           *[a for s in sets for a in ("--set", s)]], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.load(out)


@pytest.mark.slow
def test_packing_on_the_cpu_is_within_the_tolerances_for_ten_steps(tmp_path):
    """The control behind the tolerances: the same model, batches and math with the samples packed into
    one row (another summation order) stays within them for 10 steps."""
    h = _harness()
    base, packed = _run(tmp_path, "base", 10), _run(tmp_path, "packed", 10, "sequence_packing=true")
    assert base["device"] == "cpu" and len(base["steps"]) == 10
    worst = h.compare(base, packed)
    assert h.failures(worst) == [], worst
    assert worst["init"] == 0.0 and worst["update"] > 0  # same start; the packed run did compute its own steps


def test_a_different_adam_beta2_fails_the_comparison(tmp_path):
    """What the GPU test must catch: one hyper-parameter lost on the way to the optimizer (Adam's beta2
    0.999 instead of the config's 0.98) already fails after two steps."""
    h = _harness()
    worst = h.compare(_run(tmp_path, "base", 2), _run(tmp_path, "beta2", 2, "adam_beta2=0.999"))
    assert worst["loss"] <= 1e-5 and worst["weights@0"] <= 1e-5  # beta2 does not change Adam's first step
    assert any(f.startswith("weights ") for f in h.failures(worst)), worst


def test_compare_command_line_reports_failures(tmp_path):
    base = _run(tmp_path, "a", 1)
    other = _run(tmp_path, "b", 1, "lr=2.97e-3")  # 1% off
    torch.save(base, tmp_path / "a.pt")
    torch.save(other, tmp_path / "b.pt")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 1 and "weights" in proc.stdout.split("|")[1], proc.stdout
