"""The shipped contract suites, run over every registered built-in: a new built-in is covered for free."""

import pytest

from posttrain.core.plugins import load_plugins
from posttrain.testing import (CorrectionContract, EstimatorContract, FilterContract, GeneratorContract, LossContract, ModelSpecContract,
                               RewardContract)

PLUGINS = load_plugins(autoload=False)  # posttrain's own components only


def _ours(kind: str) -> list:
    registry = PLUGINS.registry(kind)
    names = sorted(n for n in registry if registry.provider(n).distribution == "posttrain")
    return names or [pytest.param(None, marks=pytest.mark.skip(reason=f"no built-in {kind} yet"))]


def _instance(kind: str, name: str):
    cls = PLUGINS.registry(kind)[name]
    return cls(cls.Config())


class TestEstimators(EstimatorContract):
    @pytest.fixture(params=_ours("estimators"))
    def estimator(self, request):
        return _instance("estimators", request.param)


class TestLosses(LossContract):
    @pytest.fixture(params=_ours("losses"))
    def loss(self, request):
        return _instance("losses", request.param)


class TestCorrections(CorrectionContract):
    @pytest.fixture(params=_ours("corrections"))
    def correction(self, request):
        return _instance("corrections", request.param)


class TestRewards(RewardContract):
    @pytest.fixture(params=_ours("rewards"))
    def reward(self, request):
        return _instance("rewards", request.param)


class TestGenerators(GeneratorContract):
    @pytest.fixture(params=_ours("generators"))
    def generator(self, request):
        return _instance("generators", request.param)


class TestModelSpecs(ModelSpecContract):
    @pytest.fixture(params=_ours("models"))
    def model_spec(self, request):
        return _instance("models", request.param)


class TestFilters(FilterContract):
    @pytest.fixture(params=_ours("filters"))
    def filter_(self, request):
        return _instance("filters", request.param)
