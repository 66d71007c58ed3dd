"""Shared fixtures: tiny HF checkpoints built in code, one Megatron parallel state per test process."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_glm4_checkpoint(out_dir, seed: int = 0):
    import torch
    import transformers

    from posttrain.plugins.models.glm4 import Glm4Spec
    from posttrain.testing.tiny import make_tokenizer

    hf = {k: v for k, v in Glm4Spec.presets["tiny"].items() if k not in ("model_type", "architectures", "torch_dtype")}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Glm4Config(**hf), dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    make_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    """``family -> HF checkpoint dir`` (qwen3, qwen2, llama, glm4, qwen3_moe, glm4_moe), made once per session
    on demand."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            made[family] = make_glm4_checkpoint(out) if family == "glm4" else make_tiny_checkpoint(out, family)
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


