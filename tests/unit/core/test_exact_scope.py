"""core.exact_scope: which HF configs rollout.exact covers, and config validation's one line per part it does not
(the model named, what it has, the specs whose every preset it covers listed), before anything starts."""

import pytest

from posttrain.core.config import load_config
from posttrain.core.errors import ConfigError
from posttrain.core.exact_scope import covered_models, uncovered
from posttrain.core.plugins import load_plugins

EXACT = """
estimator: grpo
rewards: [{name: exact_match}]
rollout: {rollout_batch_size: 2, n_samples_per_prompt: 4, exact: true}
trainer: {global_batch_size: 8, micro_batch_size: 8}
"""


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def test_uncovered_names_each_part_from_the_hf_config(plugins):
    models = plugins.models
    for name in ("qwen3", "llama3", "qwen2", "glm4", "qwen3_moe", "glm4_moe"):
        for preset in models[name].presets.values():
            assert uncovered(preset) == [], (name, preset)
    assert uncovered(models["deepseek_v3"].presets["tiny"]) == []  # latent attention, no rope scaling
    assert uncovered(models["deepseek_v3"].presets["moonlight-16B-A3B"]) == []
    assert uncovered(models["deepseek_v3"].presets["deepseek-v3"]) == ["yarn rope scaling (rope_scaling)"]
    assert uncovered({"hidden_act": "gelu_pytorch_tanh", "use_sliding_window": True,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}) == [
        "a gelu_pytorch_tanh activation (hidden_act; exact mode computes SiLU)",
        "sliding-window attention (use_sliding_window)"]
    covered = covered_models(models)
    assert "glm4_moe" in covered and "qwen3" in covered and "deepseek_v3" not in covered  # not every preset
    assert all(not getattr(models[n], "generic", False) for n in covered)  # a spec of any architecture is not listed


def test_config_validation_refuses_an_uncovered_model_in_one_line(write, plugins):
    with pytest.raises(ConfigError) as info:
        load_config(write("c.yaml", EXACT + "model: {name: deepseek_v3, preset: kimi-k2, dtype: float32}\n"),
                    plugins=plugins)
    assert info.value.errors == [
        f"rollout.exact: model deepseek_v3 has yarn rope scaling (rope_scaling), which exact mode does not cover "
        f"(covered: {', '.join(covered_models(plugins.models))})"]
    for name in ("glm4_moe", "deepseek_v3"):
        cfg = load_config(write("d.yaml", EXACT + f"model: {{name: {name}, preset: tiny, dtype: float32}}\n"),
                          plugins=plugins)
        assert cfg.rollout.exact and cfg.model.name == name
    off = load_config(write("e.yaml", EXACT.replace("exact: true", "exact: false")
                            + "model: {name: deepseek_v3, preset: kimi-k2}\n"), plugins=plugins)
    assert not off.rollout.exact


def test_expert_parallelism_is_refused_with_exact_mode(write, plugins):
    with pytest.raises(ConfigError) as info:
        load_config(write("c.yaml", EXACT.replace("micro_batch_size: 8}", "micro_batch_size: 8, backend: {ep: 2}}")
                          + "model: {name: glm4_moe, preset: tiny, dtype: float32}\nresources: {trainer_procs_per_node: 2}\n"),
                    plugins=plugins)
    assert [e for e in info.value.errors if e.startswith("rollout.exact")] == [
        "rollout.exact: needs trainer.backend.ep: 1 (expert parallelism sums a token's experts on other ranks, in "
        "another order than the engine's)"], info.value.errors


def test_the_engine_must_compute_in_the_trainers_dtype(write, plugins):
    half = EXACT + "model: {name: qwen3, preset: tiny, dtype: bfloat16}\n"
    with pytest.raises(ConfigError) as info:  # auto on the CPU is float32
        load_config(write("c.yaml", half), plugins=plugins)
    assert info.value.errors == ["rollout.exact: the engine computes in float32 (rollout.engine.dtype), the trainer "
                                 "in bfloat16 (model.dtype): set rollout.engine.dtype: bfloat16"]
    fixed = half.replace("exact: true}", "exact: true, engine: {name: local, dtype: bfloat16}}")
    assert load_config(write("d.yaml", fixed), plugins=plugins).rollout.exact
    gpu = half.replace("exact: true}", "exact: true, engine: {name: local, device: cuda}}")  # auto: the checkpoint's
    assert load_config(write("e.yaml", gpu), plugins=plugins).rollout.exact
