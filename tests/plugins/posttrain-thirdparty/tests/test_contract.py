"""The posttrain contracts over this package's backends, as a third-party author runs them."""

import pytest

from posttrain.testing import EngineContract, TrainerContract
from posttrain_thirdparty.hf_engine import HFGenerateEngine
from posttrain_thirdparty.torch_trainer import TorchSimpleTrainer


class TestHFGenerate(EngineContract):
    @pytest.fixture
    def engine_backend(self):
        return HFGenerateEngine(HFGenerateEngine.Config())


class TestTorchSimple(TrainerContract):
    @pytest.fixture
    def trainer_backend(self):
        return TorchSimpleTrainer(TorchSimpleTrainer.Config())  # device auto: CUDA where there is one


def test_discovered_through_the_entry_points():
    from posttrain.core.plugins import load_plugins

    plugins = load_plugins()
    assert plugins.registry("engine")["hf_generate"] is HFGenerateEngine
    assert plugins.registry("trainer")["torch_simple"] is TorchSimpleTrainer
    assert plugins.registry("engine").provider("hf_generate").distribution == "posttrain-thirdparty"
