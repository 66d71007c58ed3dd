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

from posttrain.testing.contracts.common import ComponentContract
from posttrain.testing.contracts.estimator import EstimatorContract
from posttrain.testing.contracts.filter import FilterContract
from posttrain.testing.contracts.generator import GeneratorContract
from posttrain.testing.contracts.loss import LossContract
from posttrain.testing.contracts.model import ModelSpecContract
from posttrain.testing.contracts.reward import RewardContract

# registry kind -> (contract class name, fixture the subclass supplies)
CONTRACTS = {
    "estimators": ("EstimatorContract", "estimator"),
    "losses": ("LossContract", "loss"),
    "rewards": ("RewardContract", "reward"),
    "generators": ("GeneratorContract", "generator"),
    "models": ("ModelSpecContract", "model_spec"),
    "filters": ("FilterContract", "filter_"),
}

__all__ = ["CONTRACTS", "ComponentContract", "EstimatorContract", "FilterContract", "GeneratorContract",
           "LossContract", "ModelSpecContract", "RewardContract"]
