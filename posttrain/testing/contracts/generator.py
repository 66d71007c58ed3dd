"""The generator contract (extended by the rollout work): generic checks for now."""

import pytest

from posttrain.testing.contracts.common import ComponentContract


class GeneratorContract(ComponentContract):
    """Supply a ``generator`` fixture."""

    @pytest.fixture
    def component(self, generator):
        return generator

    def test_is_async_callable(self, generator):
        import inspect

        assert inspect.iscoroutinefunction(type(generator).__call__), "generators are `async def __call__`"
