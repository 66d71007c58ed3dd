"""Fixtures: a tiny random Qwen3 checkpoint, HF's model of it, and a local engine server subprocess."""

from __future__ import annotations

import pytest

from posttrain.testing.engine import start_local_engine


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from posttrain.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3", family="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_b(tmp_path_factory):
    """Same shape, other random weights (the 'trained' weights of the weight-update tests)."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_b") / "qwen3", family="qwen3", seed=1)


@pytest.fixture(scope="session")
def hf_model(tiny_ckpt):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def engine_url(tiny_ckpt, tmp_path_factory):
    server = start_local_engine(tiny_ckpt, tmp_path_factory.mktemp("logs"))
    yield server.base_url
    server.stop()
