"""The model-spec contract (extended by the training work): generic checks for now."""

import pytest

from posttrain.testing.contracts.common import ComponentContract


class ModelSpecContract(ComponentContract):
    """Supply a ``model_spec`` fixture."""

    @pytest.fixture
    def component(self, model_spec):
        return model_spec
