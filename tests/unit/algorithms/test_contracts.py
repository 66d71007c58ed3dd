"""Run the estimator, loss and correction contracts over every registered built-in of those kinds."""

from __future__ import annotations

import pytest

from posttrain.core.plugins import load_plugins
from posttrain.testing.contracts.correction import CorrectionContract
from posttrain.testing.contracts.estimator import EstimatorContract
from posttrain.testing.contracts.loss import LossContract

PLUGINS = load_plugins()


def _build(kind: str, name: str):
    cls = PLUGINS.registry(kind)[name]
    return cls(cls.Config())


# The contract's generic checks ask for `component`; parametrizing that fixture (rather than the
# kind-specific one it looks up dynamically) lets pytest see the parameters.
class TestEstimators(EstimatorContract):
    @pytest.fixture(params=sorted(PLUGINS.estimators))
    def component(self, request):
        return _build("estimators", request.param)

    @pytest.fixture
    def estimator(self, component):
        return component


class TestLosses(LossContract):
    @pytest.fixture(params=sorted(PLUGINS.losses))
    def component(self, request):
        return _build("losses", request.param)

    @pytest.fixture
    def loss(self, component):
        return component


class TestCorrections(CorrectionContract):
    @pytest.fixture(params=sorted(PLUGINS.corrections))
    def component(self, request):
        return _build("corrections", request.param)

    @pytest.fixture
    def correction(self, component):
        return component


def test_every_algorithm_is_registered():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae", "remax",
            "opo", "gpg", "grpo_passk"} <= set(PLUGINS.estimators)
    assert {"ppo_clip", "gspo", "cispo", "gmpo", "reinforce"} <= set(PLUGINS.losses)
    assert {"tis", "mis", "icepop"} <= set(PLUGINS.corrections)
