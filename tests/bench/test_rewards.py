"""bench/rewards.py runs and prints one JSON line (the full 10,000-sample run is for the lead)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_bench_prints_one_json_line():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rewards.py"), "--n", "48", "--workers", "1,2"],
                         capture_output=True, text=True, timeout=180, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["samples"] == 48
    for key in ("workers_1", "workers_2"):
        assert result[key]["samples_per_s"] > 0 and result[key]["failed"] == 0
    assert result["workers_1"]["mean_score"] == result["workers_2"]["mean_score"] > 0
