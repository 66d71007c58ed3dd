"""rollout.exact on one GPU (skipped without CUDA): the checks of issue 56's GPU part, in one call.

    python -m pytest -q tests/gpu/test_exact.py -m gpu

- the Triton matmul of ``core.exact_kernel``: a row's result the same bits alone, in a batch, against a subset
  of the columns and with a zero tail of K, in bf16 and fp32 (cuBLAS, for contrast, is not);
- five steps of ``examples/gpu/qwen3-1.7b-grpo.yaml`` colocated on one GPU (bf16; ``POSTTRAIN_GPU_PRESET`` picks
  another shape) and of ``examples/gpu/qwen3-30b-a3b-grpo.yaml`` cut to 2 layers (routing replay) in exact mode:
  ``train_rollout_logprob_abs_diff_max`` exactly 0.0 at every step, and ``rl-cli run``'s closing line says so.

Speed in exact mode against the default, measured in one call: ``python -m bench rollout --exact`` (decode tok/s)
and ``python -m bench train --exact`` (train TFLOP/s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EXACT = ["rollout.exact=true", "trainer.backend.compile=false", "rollout.num_rollouts=5", "resources.colocate=true",
         "rollout.min_new_tokens=64", "rollout.max_new_tokens=64"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matmul_is_batch_invariant_on_the_gpu(dtype):
    from posttrain.core import exact, exact_kernel

    assert exact_kernel.triton_ok()
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(1, 777, 2048, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(1, 2048, 3000, device="cuda", dtype=dtype, generator=g)
    full = exact.bmm(a, b)
    torch.testing.assert_close(full.float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-1)
    for rows in (slice(5, 6), slice(100, 164), slice(0, 777)):
        assert torch.equal(exact.bmm(a[:, rows], b[:, :, 17:1500]), full[:, rows, 17:1500])
    tail = exact.bmm(torch.cat([a, torch.zeros_like(a[..., :96])], -1), torch.cat([b, b[:, :96]], 1))
    assert torch.equal(tail, full)
    lp = exact.log_softmax(full[0, :64].float())
    assert torch.equal(exact.log_softmax(full[0, 3:4].float()), lp[3:4])


def _run(tmp_path, config, *overrides):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", str(ROOT / "examples" / "gpu" / config),
                          "--run-dir", str(run), *EXACT, *overrides], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        log = run / "logs" / "engine-0.log"
        pytest.fail(out.stdout[-2000:] + out.stderr[-3000:] + "\n--- engine-0.log ---\n"
                    + (log.read_text(errors="replace")[-4000:] if log.exists() else ""))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    assert [r["train_rollout_logprob_abs_diff_max"] for r in rows] == [0.0] * 5, rows
    assert "exact: every token matched" in out.stdout, out.stdout[-1000:]
    return rows


def test_dense_example_matches_every_token_for_five_steps(tmp_path):
    _run(tmp_path, "qwen3-1.7b-grpo.yaml", f"model.preset={os.environ.get('POSTTRAIN_GPU_PRESET', 'qwen3-1.7B')}",
         "rollout.rollout_batch_size=16", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=64",
         "trainer.micro_batch_size=16", "trainer.max_tokens_per_micro_batch=8192",
         "rollout.engine.context_length=128", "rollout.engine.max_running_requests=64")


def test_moe_example_with_routing_replay_matches_every_token_for_five_steps(tmp_path):
    _run(tmp_path, "qwen3-30b-a3b-grpo.yaml", "model.overrides={num_hidden_layers: 2}",
         "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=32",
         "trainer.micro_batch_size=16")
