"""Shared fixtures: tiny HF checkpoints built in code, one Megatron parallel state per test process."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    """``family -> HF checkpoint dir`` (qwen3, qwen2, llama, glm4, qwen3_moe, glm4_moe, deepseek_v3), made once per session
    on demand."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            made[family] = make_tiny_checkpoint(out, family)
        return made[family]

    return get


@pytest.fixture(scope="session")
def megatron_tp1():
    """torch.distributed (gloo, one process) + Megatron parallel state with TP=1, for the whole session."""
    import torch

    torch.set_num_threads(1)
    from posttrain.plugins.trainers.megatron.model import init_parallel

    init_parallel(1, 1, seed=0)
    yield


