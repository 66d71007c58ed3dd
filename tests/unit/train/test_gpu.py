"""GPU-only checks (skipped without CUDA). On a GPU machine every other test in this folder also runs on
CUDA: the trainer picks NCCL, Megatron's DDP and distributed optimizer by itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[3]


def test_trainer_uses_megatron_distributed_optimizer_and_learns_in_bf16(tiny_ckpts, megatron_tp1):
    from posttrain.core.config import TrainerConfig
    from posttrain.core.train.trainer import MegatronTrainer
    from train_helpers import local_loss, spec_for, tp_batch

    trainer = MegatronTrainer(spec_for("qwen3", tiny_ckpts("qwen3"), dtype="bfloat16"),
                              TrainerConfig(lr=3e-3, micro_batch_size=2, global_batch_size=4))
    assert trainer.megatron_optimizer and type(trainer.model).__name__ == "DistributedDataParallel"
    batch = tp_batch()
    batch.advantages = batch.response_mask.clone()
    batch.old_log_probs = trainer.log_probs(batch)[0]
    losses = [trainer.train_step(batch, local_loss)["loss"] for _ in range(10)]
    assert losses[-1] < losses[0]


def test_bench_runs_on_cuda():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "train.py"), "--preset", "tiny", "--device", "cuda",
                          "--seq-len", "256", "--steps", "2", "--warmup", "1"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tokens_per_s"] > 0 and result["peak_mem_gib"] > 0
