import pytest

from posttrain.core.config import apply_overrides, load_config
from posttrain.core.errors import ConfigError
from posttrain.core.plugins import load_plugins

GOOD = """
estimator: {name: grpo, epsilon: 1.0e-5}
rewards: [{name: exact_match, weight: 0.5}]
rollout: {rollout_batch_size: 4, n_samples_per_prompt: 4}
trainer: {global_batch_size: 8, micro_batch_size: 4, steps_per_rollout: 2}
"""


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def test_good_config_resolves_components(write, plugins):
    cfg = load_config(write("c.yaml", GOOD), plugins=plugins)
    assert cfg.estimator.name == "grpo" and cfg.estimator.config.epsilon == 1e-5
    assert cfg.rewards[0].weight == 0.5
    est = cfg.estimator.create(plugins)
    assert type(est) is plugins.estimators["grpo"]
    assert cfg.to_dict()["rewards"] == [{"name": "exact_match", "ignore_case": False, "think_end": None,
                                         "weight": 0.5}]


def test_resolved_dict_round_trips(write, plugins):
    cfg = load_config(write("c.yaml", GOOD), plugins=plugins)
    again = load_config(None, data=cfg.to_dict(), plugins=plugins)
    assert again.to_dict() == cfg.to_dict()


def test_overrides_are_typed_and_reach_lists(write, plugins):
    cfg = load_config(write("c.yaml", GOOD), ["estimator.epsilon=1e-4", "rewards.0.weight=2",
                                               "rewards.0.ignore_case=true"], plugins)
    assert cfg.estimator.config.epsilon == 1e-4
    assert cfg.rewards[0].weight == 2.0 and cfg.rewards[0].config.ignore_case is True


def test_bad_overrides_are_errors():
    raw = {"rewards": [{"name": "x"}]}
    errors = apply_overrides(raw, ["noequals", "rewards.3.weight=1", "rewards.0.weight=1"])
    assert len(errors) == 2 and "an override must look like key.sub=value" in errors[0]
    assert "has no item 3 (it has 1)" in errors[1]
    assert raw["rewards"][0]["weight"] == 1


def test_five_mistakes_five_errors(write, plugins):
    path = write("bad.yaml", """
estimator: {name: grop}
rewards: [{name: exact_match, ignore_cse: true}]
rollout: {rollout_batch_size: -3}
trainer: {lrr: 1}
data: {path: missing.jsonl}
""")
    with pytest.raises(ConfigError) as info:
        load_config(path, plugins=plugins)
    errors = info.value.errors
    assert len(errors) == 5, errors
    assert any("unknown estimator 'grop'. Did you mean 'grpo'?" in e for e in errors)
    assert any(e.startswith("rewards.0.ignore_cse: unknown key") for e in errors)
    assert any(e.startswith("rollout.rollout_batch_size: -3 is out of range") for e in errors)
    assert any(e.startswith("trainer.lrr: unknown key") for e in errors)
    assert any(e == "data.path: no such file or directory: missing.jsonl" for e in errors)


def test_batch_identity(write, plugins):
    path = write("c.yaml", GOOD.replace("steps_per_rollout: 2", "steps_per_rollout: 1"))
    with pytest.raises(ConfigError) as info:
        load_config(path, plugins=plugins)
    assert "batch identity violated" in info.value.errors[0] and "16 != " in info.value.errors[0]


def test_batch_identity_reported_beside_other_errors(write, plugins):
    path = write("c.yaml", GOOD.replace("steps_per_rollout: 2", "steps_per_rollout: 1") + "seed: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, plugins=plugins)
    assert len(info.value.errors) == 2


def test_missing_required_component(write, plugins):
    with pytest.raises(ConfigError) as info:
        load_config(write("c.yaml", "rollout: {rollout_batch_size: 8}\n"), plugins=plugins)
    assert "estimator: required key is missing" in info.value.errors


@pytest.mark.parametrize("text, needle", [
    ("a: [1,\n", "invalid YAML"),
    ("- 1\n- 2\n", "the top level must be a mapping"),
])
def test_unreadable_files(write, plugins, text, needle):
    with pytest.raises(ConfigError) as info:
        load_config(write("c.yaml", text), plugins=plugins)
    assert needle in str(info.value)


def test_missing_config_file(tmp_path, plugins):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml", plugins=plugins)


def test_colocated_runs_refuse_async_and_nccl_on_one_gpu(write, plugins):
    path = write("c.yaml", GOOD + "resources: {colocate: true}\n")
    overrides = ["rollout.mode=async", "rollout.weight_sync=distributed", "rollout.engine.device=cuda"]
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, plugins=plugins)
    assert [e.split(":")[0] for e in info.value.errors] == ["rollout.mode", "rollout.weight_sync"]


@pytest.mark.parametrize("colocate, given, mode", [(True, "auto", "tensor"), (False, "auto", "distributed"),
                                                   (True, "disk", "disk"), (False, "tensor", "tensor")])
def test_weight_sync_auto_follows_colocation(write, plugins, colocate, given, mode):
    path = write("c.yaml", GOOD + f"resources: {{colocate: {str(colocate).lower()}}}\n")
    cfg = load_config(path, [f"rollout.weight_sync={given}"], plugins=plugins)
    assert cfg.rollout.weight_sync_mode(cfg.resources.colocate) == mode


def test_trainer_world_size_from_nodes_and_procs(write, plugins):
    cfg = load_config(write("c.yaml", GOOD), ["resources.executor=ray", "resources.trainer_nodes=2",
                                              "resources.trainer_procs_per_node=3", "trainer.backend.tp=3"], plugins)
    assert cfg.resources.trainer_world_size == 6
    assert load_config(write("c.yaml", GOOD), plugins=plugins).resources.trainer_world_size == 1  # CPU default
    gpus = load_config(write("c.yaml", GOOD), ["resources.trainer_gpus_per_node=4"], plugins)
    assert gpus.resources.trainer_world_size == 4  # a rank per GPU


def test_trainer_group_layout_mistakes_name_their_keys(write, plugins):
    """The backend's layout mistakes at once, before anything starts: world % (tp*pp*cp), CP on CPU, PP
    without packing; and the resources' own: several nodes without Ray, more ranks than GPUs."""
    with pytest.raises(ConfigError) as info:
        load_config(write("c.yaml", GOOD), ["resources.trainer_procs_per_node=3", "trainer.backend.tp=2",
                                            "trainer.backend.pp=2", "trainer.backend.sequence_packing=false",
                                            "trainer.backend.cp=2"], plugins)
    errors = info.value.errors
    assert "trainer.backend: world size 3 (resources.trainer_nodes 1 x resources.trainer_procs_per_node 3) is not " \
           "a multiple of trainer.backend.tp x pp x cp = 2 x 2 x 2 = 8" in errors
    assert any(e.startswith("trainer.backend.cp: context parallelism runs on GPUs only") for e in errors)
    assert any(e.startswith("trainer.backend.pp: pipeline parallelism (2 stages) needs "
                            "trainer.backend.sequence_packing: true") for e in errors)
    assert len(errors) == 3, errors
    with pytest.raises(ConfigError) as info:
        load_config(write("c.yaml", GOOD), ["resources.trainer_nodes=2", "resources.trainer_gpus_per_node=1",
                                            "resources.trainer_procs_per_node=2"], plugins)
    assert [e.split(":")[0] for e in info.value.errors] == ["resources.trainer_nodes", "resources.trainer_procs_per_node"]
    assert "2 nodes need resources.executor: ray" in info.value.errors[0]
    assert "2 ranks per node but trainer_gpus_per_node is 1" in info.value.errors[1]
    with pytest.raises(ConfigError, match="trainer.global_batch_size: 8 samples cannot be split over 16"):
        load_config(write("c.yaml", GOOD), ["resources.trainer_procs_per_node=16"], plugins)
