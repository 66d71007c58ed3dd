"""The generator contract (extended by the rollout work): generic checks for now."""

from posttrain.testing.contracts.common import ComponentContract


class GeneratorContract(ComponentContract):
    """Supply a ``generator`` fixture."""

    fixture_name = "generator"

    def test_is_async_callable(self, generator):
        import inspect

        assert inspect.iscoroutinefunction(type(generator).__call__), "generators are `async def __call__`"
