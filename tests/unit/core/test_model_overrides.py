"""``model.overrides``: HF config.json keys applied on top of a preset or checkpoint (a preset cut to fit)."""

import json

import pytest

from posttrain.core.config import load_config
from posttrain.core.errors import ConfigError
from posttrain.core.plugins import load_plugins

RUN = """
model: {name: qwen3_moe, preset: tiny}
estimator: grpo
rewards: [exact_match]
rollout: {rollout_batch_size: 4, n_samples_per_prompt: 4}
trainer: {global_batch_size: 16, micro_batch_size: 4}
"""


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def test_overrides_apply_on_top_of_the_preset_and_leave_it_alone(plugins):
    cls = plugins.registry("models")["qwen3_moe"]
    layers = cls.presets["tiny"]["num_hidden_layers"]
    spec = cls(cls.Config(preset="tiny", overrides={"num_hidden_layers": 1, "mlp_only_layers": [0]}))
    hf = spec.hf_config()
    assert hf["num_hidden_layers"] == 1 and hf["mlp_only_layers"] == [0]
    hf["mlp_only_layers"].append(5)  # the caller's copy; neither the preset nor the next call sees it
    assert cls.presets["tiny"]["num_hidden_layers"] == layers and cls.presets["tiny"]["mlp_only_layers"] == []
    assert spec.hf_config()["mlp_only_layers"] == [0]


def test_overrides_apply_on_top_of_a_checkpoint_config(plugins, tmp_path):
    cls = plugins.registry("models")["qwen3"]
    (tmp_path / "config.json").write_text(json.dumps({**cls.presets["tiny"], "num_hidden_layers": 4}))
    spec = cls(cls.Config(path=str(tmp_path), overrides={"num_hidden_layers": 2}))
    assert spec.hf_config()["num_hidden_layers"] == 2
    assert spec.check_config() == []


def test_an_unknown_override_key_is_one_config_error_naming_it(plugins, write):
    with pytest.raises(ConfigError) as exc:
        load_config(write("c.yaml", RUN), ["model.overrides={num_hidden_layer: 1, rope_theta: 1.0}"], plugins)
    errors = exc.value.errors
    assert errors == ["model.overrides.num_hidden_layer: not a key of the HF config of preset 'tiny'. "
                      "Did you mean 'num_hidden_layers'?"]
    cls = plugins.registry("models")["qwen3_moe"]
    with pytest.raises(ConfigError, match="model.overrides.first_k_dense_replace"):  # a GLM key on a Qwen spec
        cls(cls.Config(overrides={"first_k_dense_replace": 1})).hf_config()


def test_a_valid_override_loads_and_is_in_the_resolved_config(plugins, write):
    cfg = load_config(write("c.yaml", RUN), ["model.overrides.num_hidden_layers=1"], plugins)
    assert cfg.model.create(plugins).hf_config()["num_hidden_layers"] == 1
    assert cfg.to_dict()["model"]["overrides"] == {"num_hidden_layers": 1}


def test_an_unknown_preset_is_reported_with_the_config_errors(plugins, write):
    with pytest.raises(ConfigError) as exc:
        load_config(write("c.yaml", RUN), ["model.preset=qwen3-31B"], plugins)
    assert len(exc.value.errors) == 1 and exc.value.errors[0].startswith("model.preset: unknown preset 'qwen3-31B'")
