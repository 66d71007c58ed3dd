"""Pyflakes' checks (ruff's ``F`` rules, ``[tool.ruff]`` in pyproject.toml) over the package, the tests, the
benchmarks and the examples: an undefined name or a stale import fails here, also in code no CPU test runs (the
GPU-only branches, ``bench/``), where it would otherwise first show on a GPU machine."""

import subprocess
import sys

from tests.conftest import ROOT


def test_no_undefined_names_or_unused_imports():
    paths = ["posttrain", "tests", "bench", "examples"]
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *paths], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
