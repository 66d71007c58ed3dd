"""Fixtures: a tiny random Qwen3 checkpoint and local engine servers (subprocesses on free loopback ports)."""

from __future__ import annotations

import os

import pytest

from posttrain.core.rollout.launcher import ManagedServer, local_engine_command
from posttrain.core.rollout.procs import free_port

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def start_engine(model_dir, log_dir, **options) -> ManagedServer:
    port = free_port()
    options.setdefault("context_length", 256)
    options.setdefault("max_running_requests", 8)
    cmd = local_engine_command(str(model_dir), port, **options)
    return ManagedServer(cmd, f"http://127.0.0.1:{port}", log_path=os.path.join(log_dir, f"engine-{port}.log"),
                         env=ENV, ready_timeout_s=120).start()


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
    server = start_engine(tiny_ckpt, str(tmp_path_factory.mktemp("logs")))
    yield server.base_url
    server.stop()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF ``generate``'s greedy continuation (no EOS stop: the engine is asked to ignore EOS too)."""
    import torch

    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, min_new_tokens=n)
    return out[0, len(prompt):].tolist()
