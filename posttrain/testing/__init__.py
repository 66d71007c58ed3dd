"""Contract tests for plugin authors, shipped with posttrain.

Subclass the contract for your component's kind and supply one fixture::

    import pytest
    from posttrain.testing import EstimatorContract

    class TestMyEstimator(EstimatorContract):
        @pytest.fixture
        def estimator(self):
            return MyEstimator(MyEstimator.Config())

pytest then runs every inherited check. posttrain runs the same suites over all of its built-ins
(``tests/contract``), and ``rl-cli plugins check NAME`` runs them over an installed plugin.
"""

import importlib

# class name -> module under posttrain.testing.contracts; imported on first use (PEP 562), so the pytest
# plugin can register assertion rewriting for the contracts before they are imported.
_LAZY = {
    "ComponentContract": "common",
    "CorrectionContract": "correction",
    "EngineContract": "engine",
    "EstimatorContract": "estimator",
    "FilterContract": "filter",
    "GeneratorContract": "generator",
    "LossContract": "loss",
    "ModelSpecContract": "model",
    "RewardContract": "reward",
    "TrainerContract": "trainer",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"posttrain.testing.contracts.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'posttrain.testing' has no attribute {name!r}")


# registry kind -> (contract class name, fixture the subclass supplies)
CONTRACTS = {
    "estimators": ("EstimatorContract", "estimator"),
    "losses": ("LossContract", "loss"),
    "corrections": ("CorrectionContract", "correction"),
    "rewards": ("RewardContract", "reward"),
    "generators": ("GeneratorContract", "generator"),
    "models": ("ModelSpecContract", "model_spec"),
    "filters": ("FilterContract", "filter_"),
    "engines": ("EngineContract", "engine_backend"),
    "trainers": ("TrainerContract", "trainer_backend"),
}

__all__ = ["CONTRACTS", "ComponentContract", "CorrectionContract", "EngineContract", "EstimatorContract",
           "FilterContract", "GeneratorContract", "LossContract", "ModelSpecContract", "RewardContract",
           "TrainerContract"]
