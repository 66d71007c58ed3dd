"""The model-spec contract (extended by the training work): generic checks for now."""

from posttrain.testing.contracts.common import ComponentContract


class ModelSpecContract(ComponentContract):
    """Supply a ``model_spec`` fixture."""

    fixture_name = "model_spec"
