"""The pytest plugin (entry point ``pytest11``): assert rewriting for the contracts, and fixtures."""

import pytest

pytest.register_assert_rewrite("posttrain.testing.contracts")


@pytest.fixture
def plugins():
    """A fresh ``load_plugins()`` result: every installed plugin, as a run would see it."""
    from posttrain.core.plugins import load_plugins

    return load_plugins()
