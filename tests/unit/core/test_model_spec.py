"""Model specs: presets and model_type lookup (tests/contract runs the spec contract over each family)."""

from __future__ import annotations

import pytest

from posttrain.core.errors import UsageError
from posttrain.core.plugins import load_plugins
from posttrain.core.model_spec import count_params, spec_for_model_type

SPECS = ["qwen3", "qwen2", "llama3", "glm4"]


@pytest.mark.parametrize("family,preset,billions", [
    ("qwen3", "qwen3-0.6B", 0.60), ("qwen3", "qwen3-1.7B", 1.72), ("qwen3", "qwen3-4B", 4.02),
    ("qwen3", "qwen3-8B", 8.19), ("qwen2", "qwen2.5-0.5B", 0.49), ("qwen2", "qwen2.5-1.5B", 1.54),
    ("qwen2", "qwen2.5-7B", 7.62), ("llama3", "llama3-8B", 8.03), ("glm4", "glm4-9B", 9.40),
])
def test_presets_have_the_published_sizes(family, preset, billions):
    hf = load_plugins().registry("model")[family].presets[preset]
    # biases are not counted by count_params; they are < 0.1% of these models
    assert abs(count_params(hf) / 1e9 - billions) < 0.015, count_params(hf)


def test_model_type_selects_the_family():
    registry = load_plugins().registry("model")
    assert spec_for_model_type(registry, "qwen3").name == "qwen3"
    assert spec_for_model_type(registry, "llama").name == "llama3"
    assert spec_for_model_type(registry, "glm4").name == "glm4"
    with pytest.raises(UsageError, match="qwen3"):
        spec_for_model_type(registry, "qwen4")


def test_unknown_preset_is_a_config_error():
    from posttrain.core.errors import ConfigError

    cls = load_plugins().registry("model")["qwen3"]
    with pytest.raises(ConfigError, match="qwen3-1.7B"):
        cls(cls.Config(preset="qwen3-1.7")).hf_config()


def test_vocab_padding_is_a_multiple_of_tp_times_128():
    cls = load_plugins().registry("model")["glm4"]
    spec = cls(cls.Config(preset="glm4-9B"))
    hf = spec.hf_config()
    assert spec.padded_vocab_size(hf, 1) == 151552
    assert spec.padded_vocab_size(hf, 8) % 1024 == 0 and spec.padded_vocab_size(hf, 8) >= 151552


def test_run_config_selects_a_spec_with_its_keys(tmp_path):
    from posttrain.core.config import load_config
    from posttrain.core.errors import ConfigError

    cfg = load_config(None, data={"model": {"name": "qwen3", "preset": "qwen3-1.7B", "dtype": "bfloat16"},
                                  "estimator": "grpo"})
    assert cfg.model.name == "qwen3" and cfg.model.config.preset == "qwen3-1.7B"
    with pytest.raises(ConfigError, match="dtyp"):
        load_config(None, data={"model": {"name": "qwen3", "dtyp": "bf16"}, "estimator": "grpo"})


def test_megatron_passthrough_is_validated_against_megatron_dataclasses():
    from posttrain.core.schema import build
    from posttrain.plugins.trainers.megatron import MegatronBackend

    ok, errors = build(MegatronBackend.Config, {"megatron": {"recompute_granularity": "full",
                                                             "overlap_grad_reduce": True, "adam_beta2": 0.95}},
                       "trainer.backend")
    assert errors == [] and ok.megatron["recompute_granularity"] == "full"
    _, errors = build(MegatronBackend.Config, {"megatron": {"recompute_granularty": "full"}}, "trainer.backend")
    assert len(errors) == 1 and "recompute_granularty" in errors[0] and "recompute_granularity" in errors[0]


@pytest.mark.parametrize("extra,message", [({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
                                           ({"hidden_act": "gelu"}, "gelu"), ({"use_sliding_window": True}, "sliding")])
def test_unsupported_hf_features_are_refused(extra, message):
    cls = load_plugins().registry("model")["qwen2"]
    spec = cls(cls.Config())
    with pytest.raises(UsageError, match=message):
        spec.transformer_config({**spec.hf_config(), **extra})
