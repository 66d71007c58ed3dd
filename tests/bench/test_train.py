"""bench/train.py: model FLOPs counted on a MoE's ACTIVE parameters, and a cut MoE preset for one step."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BASE = dict(vocab_size=100, hidden_size=8, intermediate_size=40, num_attention_heads=2, num_key_value_heads=1,
            head_dim=4, moe_intermediate_size=6)
ATTN = 8 * 4 * (2 + 2 * 1) + 2 * 4 * 8  # q, k, v, o = 128 + 64


def test_active_params_qwen3_moe_hand_count():
    # 4 layers, 10 experts top-3, every 2nd layer sparse (layers 1 and 3), layer 3 listed dense -> only layer 1 is MoE
    hf = {**BASE, "num_hidden_layers": 4, "num_experts": 10, "num_experts_per_tok": 3, "decoder_sparse_step": 2,
          "mlp_only_layers": [3]}
    dense_layer = ATTN + 3 * 8 * 40
    moe_active = ATTN + 10 * 8 + 3 * (3 * 8 * 6)   # router + 3 routed experts
    moe_total = ATTN + 10 * 8 + 10 * (3 * 8 * 6)
    out = 100 * 8
    bench = _bench()
    assert bench.active_matmul_params(hf) == (3 * dense_layer + moe_active + out, 3 * dense_layer + moe_total + out)
    flops = bench.model_flops_per_token(hf, seq_len=16)
    assert flops == 6 * (3 * dense_layer + moe_active + out) + 12 * 4 * (2 * 4) * 16


def test_active_params_glm_moe_hand_count():
    # 3 layers, the first dense (first_k_dense_replace), 10 routed experts top-2 plus 1 shared expert
    hf = {**BASE, "num_hidden_layers": 3, "n_routed_experts": 10, "num_experts_per_tok": 2, "n_shared_experts": 1,
          "first_k_dense_replace": 1}
    moe_active = ATTN + 10 * 8 + (2 + 1) * (3 * 8 * 6)
    moe_total = ATTN + 10 * 8 + (10 + 1) * (3 * 8 * 6)
    dense = ATTN + 3 * 8 * 40
    assert _bench().active_matmul_params(hf) == (dense + 2 * moe_active + 800, dense + 2 * moe_total + 800)


def test_active_params_of_a_dense_model_are_all_of_them():
    hf = {**BASE, "num_hidden_layers": 2}
    assert _bench().active_matmul_params(hf) == (2 * (ATTN + 3 * 8 * 40) + 800,) * 2


@pytest.mark.slow
def test_bench_cut_moe_preset_one_step_json_line_per_expert_layer():
    cmd = [sys.executable, str(ROOT / "bench" / "train.py"), "--spec", "qwen3_moe", "--preset", "tiny", "--layers", "3",
           "--micro-batch", "2", "--seq-len", "16", "--steps", "1", "--warmup", "0", "--experts", "both"]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=str(ROOT),
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-3000:]
    r, sequential = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert (r["experts"], sequential["experts"]) == ("grouped", "sequential")  # one line per expert layer
    assert sequential["megatron"] == {"moe_grouped_gemm": False} and sequential["step_s"] > 0
    assert r["spec"] == "qwen3_moe" and r["layers"] == 3 and r["step_s"] > 0
    # tiny qwen3_moe: hidden 64, 4 q / 2 kv heads of 16, 8 experts of width 32, top-4, vocab 128, untied
    attn = 64 * 16 * (4 + 2 * 2) + 4 * 16 * 64
    active = 3 * (attn + 8 * 64 + 4 * 3 * 64 * 32) + 128 * 64
    total = 3 * (attn + 8 * 64 + 8 * 3 * 64 * 32) + 128 * 64
    assert (r["active_matmul_params"], r["total_matmul_params"]) == (active, total)
    assert r["active_params"] < r["total_params"]
    assert r["total_params"] - r["active_params"] == total - active  # the 4 unused experts of each layer
    assert r["model_flops_per_token"] == 6 * active + 12 * 3 * 64 * 16
