"""The shipped contract suites, run over every registered built-in: a new built-in is covered for free."""

import pytest

from posttrain.core.plugins import load_plugins
from posttrain.testing import (CorrectionContract, EngineContract, EstimatorContract, FilterContract, GeneratorContract,
                               LossContract, ModelSpecContract, RewardContract, TrainerContract)

PLUGINS = load_plugins(autoload=False)  # posttrain's own components only


def _ours(kind: str) -> list:
    registry = PLUGINS.registry(kind)
    names = sorted(n for n in registry if registry.provider(n).distribution == "posttrain")
    return names or [pytest.param(None, marks=pytest.mark.skip(reason=f"no built-in {kind} yet"))]


def _instance(kind: str, name: str):
    """Built as a run builds it: ``Cls(Cls.Config())``, then ``bind(plugins)`` where a component has it."""
    cls = PLUGINS.registry(kind)[name]
    obj = cls(cls.Config())
    if callable(getattr(obj, "bind", None)):
        obj.bind(PLUGINS)
    return obj


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


class TestEngines(EngineContract):
    """Every built-in engine backend's server: ``local`` on the CPU, ``external`` pointed at a running local
    engine, ``sglang`` where SGLang and a GPU are (never in CPU CI)."""

    @pytest.fixture(params=_ours("engines"))
    def engine_backend(self, request, tmp_path_factory):
        name = request.param
        if name == "external":
            from posttrain.testing.contracts.engine import live_engine

            import os

            local = _instance("engines", "local")
            cls = PLUGINS.registry("engines")[name]
            live = live_engine(local, request, tmp_path_factory)
            os.environ["POSTTRAIN_TEST_EXTERNAL_KEY"] = live.api_key  # a name of its own: engines never read it
            return cls(cls.Config(urls=[live.url], device="cpu", api_key_env="POSTTRAIN_TEST_EXTERNAL_KEY"))
        return _instance("engines", name)

    @pytest.fixture
    def engine(self, engine_backend, request, tmp_path_factory):
        if engine_backend.name == "sglang":  # its checks without a server still run
            pytest.importorskip("sglang", reason="the sglang backend's server needs SGLang installed (and a GPU)")
        from posttrain.testing.contracts.engine import live_engine

        return live_engine(engine_backend, request, tmp_path_factory)


class TestTrainers(TrainerContract):
    @pytest.fixture(params=_ours("trainers"))
    def trainer_backend(self, request):
        return _instance("trainers", request.param)
