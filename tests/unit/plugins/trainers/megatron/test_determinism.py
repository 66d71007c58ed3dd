"""``trainer.deterministic``: what it switches on, and that seeded sampling turns it on (CPU checks of a
GPU path; tests/gpu/test_equivalence_gpu.py checks that GPU runs then repeat)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import ROOT


def test_use_deterministic_kernels_sets_torch_and_cublas(monkeypatch):
    from posttrain.plugins.trainers.megatron.determinism import use_deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        use_deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("overrides, expected", [([], True), (["trainer.deterministic=false"], False),
                                                 (["rollout.seed_sampling=false"], False)])
def test_seeded_sampling_asks_the_trainer_for_deterministic_kernels(megatron_tp1, overrides, expected):
    from posttrain.core.actors.trainer import TrainerRole
    from posttrain.core.config import load_config

    cfg = load_config(ROOT / "examples" / "quickstart.yaml", overrides)
    assert cfg.trainer.deterministic is (False if "trainer.deterministic=false" in overrides else None)
    role = TrainerRole(cfg.to_dict())
    assert role.policy.config.deterministic is expected
    assert not torch.are_deterministic_algorithms_enabled()  # on the CPU nothing is switched
