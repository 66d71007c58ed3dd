"""Backends as components: default selection, old flat keys, and the checks backends run before start."""

import pytest

from posttrain.core.config import load_config
from posttrain.core.config_source import MOVED
from posttrain.core.errors import ConfigError
from posttrain.core.plugins import load_plugins

BASE = {"estimator": "grpo", "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4},
        "trainer": {"global_batch_size": 16, "micro_batch_size": 4}}


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def errors_of(plugins, overrides=(), data=None):
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides), plugins=plugins, data=data or BASE)
    return info.value.errors


def test_sections_left_out_select_the_registered_default_backends(plugins):
    cfg = load_config(None, plugins=plugins, data=BASE)
    assert (cfg.rollout.engine.name, cfg.trainer.backend.name) == ("local", "megatron")
    assert cfg.rollout.engine.config.device == "cpu" and cfg.trainer.backend.config.tp == 1
    # an override into a section that is not there yet keeps the default name
    cfg = load_config(None, ["rollout.engine.device=cuda", "trainer.backend.tp=2",
                             "resources.trainer_procs_per_node=2"], plugins=plugins, data=BASE)
    assert cfg.rollout.engine.name == "local" and cfg.rollout.engine.config.device == "cuda"
    assert cfg.trainer.backend.config.tp == 2
    # the resolved config names them, and round-trips
    again = load_config(None, plugins=plugins, data=cfg.to_dict())
    assert again.to_dict() == cfg.to_dict() and cfg.to_dict()["rollout"]["engine"]["name"] == "local"


def test_every_moved_key_names_its_new_place_once(plugins):
    overrides = [f"{old}=1" for old in MOVED]
    errors = errors_of(plugins, overrides)
    assert sorted(errors) == sorted(f"{old}: moved to {new}" for old, new in MOVED.items())


def test_engine_backend_checks_run_before_start(plugins):
    errors = errors_of(plugins, ["rollout.engine.device=gpu", "model=qwen3"])
    assert errors == ["rollout.engine.device: expected cpu, cuda or cuda:N, got 'gpu'"]
    errors = errors_of(plugins, ["rollout.engine={name: external}"])
    assert errors == ["rollout.engine.urls: the external backend needs at least one URL"]
    errors = errors_of(plugins, ["rollout.engine={name: sglang, args: {tp_size: 4}}"])
    assert errors == ["rollout.engine.args.tp_size: set from the run config; remove it here"]
    errors = errors_of(plugins, ["rollout.engine.nme=local"])
    assert len(errors) == 1 and errors[0].startswith("rollout.engine.nme: unknown key") and "device" in errors[0]
    errors = errors_of(plugins, ["trainer.backend.name=megatorn"])
    assert errors == ["trainer.backend.name: unknown trainer 'megatorn'. Did you mean 'megatron'? Valid: fsdp2, "
                      "megatron (see `rl-cli plugins list --kind trainer`)."]


def test_the_local_engine_refuses_a_model_it_cannot_serve(write):
    path = write("foo_spec.py", """
from posttrain import hookimpl
from posttrain.plugins.models.qwen3 import Qwen3Spec

class FooSpec(Qwen3Spec):
    name = "foo"
    hf_architecture = "FooForCausalLM"

@hookimpl
def posttrain_register_models(registry):
    registry.add(FooSpec)
""")
    plugins = load_plugins(plugin_files=[path])
    errors = errors_of(plugins, ["model=foo"])
    assert len(errors) == 1 and errors[0].startswith("rollout.engine: the local engine cannot serve FooForCausalLM")
    load_config(None, ["model=foo", "rollout.engine={name: sglang}"], plugins=plugins, data=BASE)  # SGLang may


def test_a_weight_sync_mode_the_backend_lacks_is_refused(write):
    path = write("disk_only.py", """
from posttrain import hookimpl
from posttrain.core.rollout.backend import EngineBackend

class DiskOnly(EngineBackend):
    name = "disk_only"
    weight_sync_modes = ("disk",)
    def urls(self):
        return ["http://127.0.0.1:1"]

@hookimpl
def posttrain_register_engines(registry):
    registry.add(DiskOnly)
""")
    plugins = load_plugins(plugin_files=[path])
    errors = errors_of(plugins, ["rollout.engine.name=disk_only", "rollout.weight_sync=distributed"])
    assert errors == ["rollout.weight_sync: engine backend 'disk_only' supports disk, not distributed"]
    cfg = load_config(None, ["rollout.engine.name=disk_only", "rollout.weight_sync=disk"], plugins=plugins, data=BASE)
    assert cfg.rollout.engine.create(plugins).urls() == ["http://127.0.0.1:1"]
