"""bench/rollout.py at a MoE shape (the H200 measurement runs ``--shape qwen3-30b-a3b --layers N``): one JSON
line, the cut applied, and the bandwidth bound's weight bytes counted on the experts a step reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_bench_moe_shape_counts_the_experts_a_decode_step_reads():
    prompts = 8
    cmd = [sys.executable, str(ROOT / "bench" / "rollout.py"), "--shape", "tiny-moe", "--layers", "3", "--skip-hf",
           "--prompts", str(prompts), "--prompt-len", "8", "--new-tokens", "6", "--bandwidth-gbs", "100"]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin", "PYTHONPATH": path}, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    (r,) = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert "error" not in r, r
    assert r["layers"] == 3 and r["engine_tok_s"] > 0
    # tiny-moe by hand (fp32): hidden 64, 4 q heads / 2 kv heads of 16, 8 experts of width 32, top-2, vocab 128
    attention = 64 * 64 + 2 * (64 * 32) + 64 * 64
    norms = 2 * 64 + 2 * 16  # input and post-attention RMSNorm, q/k norm
    router, experts = 8 * 64, 8 * (3 * 64 * 32)
    hit = 8 * (1 - (1 - 2 / 8) ** prompts)  # experts at least one of the 8 tokens picks (7.2)
    read = 3 * (attention + norms + router + experts * hit / 8) + 64 + 128 * 64 + prompts * 64  # + final norm,
    assert r["experts_read_per_layer"] == round(hit, 2)                                     # lm_head, 8 embed rows
    assert abs(r["decode_weight_bytes"] - 4 * read) <= 1
    assert r["params"] == 3 * (attention + norms + router + experts) + 64 + 2 * 128 * 64
    assert 2 <= r["experts_hit_last_step"] <= 8
    kv = 2 * 3 * 2 * 16 * 4 * prompts * (8 + 6 / 2)
    assert r["bandwidth_bound_tok_s"] == pytest.approx(prompts / ((4 * read + kv) / 100e9), rel=1e-3)
