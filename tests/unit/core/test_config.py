import pytest

from posttrain.core.config import load_config
from posttrain.core.config_source import apply_overrides
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


def test_overriding_a_component_name_drops_the_files_keys_for_the_old_one():
    raw = {"trainer": {"lr": 1.0, "backend": {"name": "megatron", "tp": 2, "sequence_packing": False}},
           "estimator": {"name": "grpo", "epsilon": 1e-5}}
    assert apply_overrides(raw, ["trainer.backend.device=cpu", "trainer.backend.name=torch_simple",
                                 "estimator.name=grpo"]) == []
    assert raw["trainer"]["backend"] == {"name": "torch_simple", "device": "cpu"}  # set on the command line: kept
    assert raw["estimator"] == {"name": "grpo", "epsilon": 1e-5}  # the same name keeps the section
    assert raw["trainer"]["lr"] == 1.0


def test_switching_the_model_spec_keeps_the_files_model_keys(plugins):
    """Every model spec takes the same keys: ``model.name=qwen3_moe`` on the quickstart keeps its preset, dtype
    and character tokenizer (dropping them left a preset without a tokenizer, which failed late with a traceback)."""
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "examples" / "quickstart.yaml", ["model.name=qwen3_moe"], plugins)
    assert cfg.model.name == "qwen3_moe"
    assert (cfg.model.config.preset, cfg.model.config.dtype, cfg.model.config.tokenizer) == ("tiny", "float32", "char")


def test_auto_weight_sync_falls_back_to_a_mode_the_engine_backend_has(plugins):

    from posttrain.core.config import RolloutConfig
    from posttrain.core.selection import Selection
    from posttrain.core.rollout.backend import EngineBackend

    class DiskOnly(EngineBackend):
        name = "disk_only"
        weight_sync_modes = ("disk",)

    rollout = RolloutConfig()
    rollout.engine = Selection("engines", "disk_only", DiskOnly.Config(), cls=DiskOnly)
    assert rollout.weight_sync_mode(colocate=False) == rollout.weight_sync_mode(colocate=True) == "disk"
    rollout.engine = Selection("engines", "local", None, cls=plugins.registry("engine")["local"])
    assert rollout.weight_sync_mode(colocate=False) == "distributed"
    assert rollout.weight_sync_mode(colocate=True) == "tensor"
    # colocated CPU engines: Gloo, not every weight by value in an HTTP body
    assert rollout.weight_sync_mode(colocate=True, engines_on_gpu=False) == "distributed"


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


def test_offloading_the_trainer_needs_colocation_and_a_backend_that_offloads(write, plugins):
    path = write("c.yaml", GOOD)
    assert load_config(path, ["resources.colocate=true", "resources.offload_trainer=true"], plugins=plugins)
    with pytest.raises(ConfigError) as info:
        load_config(path, ["resources.offload_trainer=true"], plugins=plugins)
    assert [e.split(":")[0] for e in info.value.errors] == ["resources.offload_trainer"]
    assert "only colocated runs offload the trainer" in info.value.errors[0]
    backend = write("plain_trainer.py", '''
from dataclasses import dataclass
from posttrain import hookimpl
from posttrain.core.trainer_backend import TrainerBackend

class PlainTrainer(TrainerBackend):
    name = "plain"
    @dataclass
    class Config:
        pass

@hookimpl
def posttrain_register_trainers(registry):
    registry.add(PlainTrainer)
''')
    with pytest.raises(ConfigError) as info:
        load_config(path, ["resources.colocate=true", "resources.offload_trainer=true", "trainer.backend.name=plain"],
                    plugins=load_plugins([backend]))
    assert any("resources.offload_trainer: trainer backend 'plain' cannot offload" in e for e in info.value.errors)


def test_offload_parts_are_checked_and_need_the_offload(write, plugins):
    path = write("c.yaml", GOOD)
    on = ["resources.colocate=true", "resources.offload_trainer=true"]
    cfg = load_config(path, [*on, "trainer.backend.offload_parts=[optimizer, grads]"], plugins=plugins)
    assert cfg.trainer.backend.config.offload_parts == ["optimizer", "grads"]
    with pytest.raises(ConfigError) as info:  # every mistake at once, each naming its key
        load_config(path, ["trainer.backend.offload_parts=[optimizer]"], plugins=plugins)
    assert info.value.errors == [("trainer.backend.offload_parts: ['optimizer'] is read only with "
                                  "resources.offload_trainer: true")]
    for parts, says in (("[]", "trainer.backend.offload_parts: empty"),
                        ("[adam]", "trainer.backend.offload_parts.0: 'adam' is not one of")):
        with pytest.raises(ConfigError) as info:
            load_config(path, [*on, f"trainer.backend.offload_parts={parts}"], plugins=plugins)
        assert len(info.value.errors) == 1 and info.value.errors[0].startswith(says), info.value.errors


@pytest.mark.parametrize("colocate, given, mode", [(True, "auto", "distributed"), (False, "auto", "distributed"),
                                                   (True, "disk", "disk"), (False, "tensor", "tensor"),
                                                   (True, "tensor", "tensor")])
def test_weight_sync_auto_follows_colocation(write, plugins, colocate, given, mode):
    path = write("c.yaml", GOOD + f"resources: {{colocate: {str(colocate).lower()}}}\n")
    cfg = load_config(path, [f"rollout.weight_sync={given}"], plugins=plugins)
    assert cfg.weight_sync_mode() == mode  # the engine is on the CPU: no GPU is shared, Gloo even colocated
    on_gpu = load_config(path, [f"rollout.weight_sync={given}", "rollout.engine.device=cuda",
                                "resources.trainer_gpus_per_node=1"], plugins=plugins)  # (cuda:1 unless colocated)
    assert on_gpu.weight_sync_mode() == ("tensor" if given == "auto" and colocate else mode)


@pytest.mark.parametrize("overrides, shared, mode", [
    # one GPU: the trainer trains on cuda:0 and engine_device=cuda puts the engine there too
    ([], [0], "tensor"),
    (["resources.trainer_gpus_per_node=1"], [], "distributed"),  # the engine goes to cuda:1
    (["rollout.engine.device=cuda:0", "resources.trainer_gpus_per_node=2"], [0], "tensor"),
    (["rollout.engine.device=cuda:2", "resources.trainer_gpus_per_node=2"], [], "distributed"),
    (["resources.executor=ray"], [], "distributed"),  # a Ray trainer with no GPUs trains on the CPU
    (["rollout.weight_sync=disk"], [0], "disk"),
])
def test_weight_sync_auto_never_puts_nccl_on_a_shared_gpu(write, plugins, overrides, shared, mode):
    from posttrain.core.config import gpus_shared_with_trainer

    cfg = load_config(write("c.yaml", GOOD), ["rollout.engine.device=cuda", *overrides], plugins=plugins)
    assert gpus_shared_with_trainer(cfg.rollout.engine.create(), cfg.resources) == shared
    assert cfg.weight_sync_mode() == mode


def test_nccl_between_trainer_and_engine_on_one_gpu_is_refused_in_one_line(write, plugins):
    with pytest.raises(ConfigError) as info:
        load_config(write("c.yaml", GOOD), ["rollout.engine.device=cuda", "rollout.weight_sync=distributed"],
                    plugins=plugins)
    (error,) = info.value.errors
    assert error.startswith("rollout.weight_sync: distributed (NCCL)") and "share cuda:0" in error
    assert "\n" not in error
    load_config(write("c.yaml", GOOD), ["rollout.engine.device=cuda", "rollout.weight_sync=distributed",
                                        "resources.trainer_gpus_per_node=1"], plugins=plugins)  # cuda:1: fine


def test_values_an_engine_cannot_run_are_refused_before_start(write, plugins):
    """The fault probe's --dry-run cases: NaN/inf never pass a float field (1e400 is a string YAML
    reads, inf once parsed), top_k is -1 or >= 1, a temperature is 0 or >= 1e-5, weights are finite."""
    bad = ["rewards.0.weight=.nan", "rollout.top_k=0", "rollout.temperature=1e-300", "trainer.lr=1e400",
           "trainer.entropy_coef=-.inf", "estimator.epsilon=.nan"]
    with pytest.raises(ConfigError) as err:
        load_config(write("c.yaml", GOOD), bad, plugins)
    text = str(err.value)
    for line in ("rewards.0.weight: expected a finite number", "rollout.top_k: 0 is out of range",
                 "rollout.temperature: 1e-300 is out of range (0 for greedy, else >= 1e-05)",
                 "trainer.lr: expected a finite number", "trainer.entropy_coef: expected a finite number",
                 "estimator.epsilon: expected a finite number"):
        assert line in text, text
    assert len(err.value.errors) == len(bad)
    ok = load_config(write("c.yaml", GOOD), ["rollout.top_k=1", "rollout.temperature=0", "trainer.lr=1e-5"], plugins)
    assert ok.rollout.top_k == 1 and ok.rollout.temperature == 0.0


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


def test_fully_async_keys_are_checked_together(write, plugins):
    path = write("c.yaml", GOOD)
    with pytest.raises(ConfigError) as err:
        load_config(path, ["rollout.partial=true", "rollout.update_weights_interval=2"], plugins)
    assert "rollout.partial: only with rollout.mode: fully_async (it is sync)" in str(err.value)
    assert "rollout.update_weights_interval: only with rollout.mode: fully_async" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(path, ["rollout.mode=fully_async", "rollout.async_buffer_size=3", "rollout.max_staleness=1",
                           "rollout.update_weights_interval=3"], plugins)
    message = str(err.value)
    assert "rollout.async_buffer_size: 3 groups cannot hold one batch (rollout_batch_size 4)" in message
    assert "rollout.max_staleness: 1 is below update_weights_interval - 1 (2)" in message
    with pytest.raises(ConfigError) as err:
        load_config(path, ["rollout.mode=fully_async", "resources.colocate=true"], plugins)
    assert "rollout.mode: fully_async overlaps generation with training" in str(err.value)


def test_fully_async_corrects_with_tis_unless_told_otherwise(write, plugins):
    path = write("c.yaml", GOOD)
    assert load_config(path, ["rollout.mode=fully_async"], plugins).correction.name == "tis"
    assert load_config(path, ["rollout.mode=fully_async", "correction=null"], plugins).correction is None
    assert load_config(path, ["rollout.mode=fully_async", "correction=mis"], plugins).correction.name == "mis"
    assert load_config(path, [], plugins).correction is None


def test_errors_about_overrides_name_the_command_line_not_only_the_file():
    from tests.conftest import ROOT

    path = ROOT / "examples" / "quickstart.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["trainer.lr=-1", "rollout.bogus=1", "seed=3"])
    assert caught.value.source == f"{path} with the command line's trainer.lr=-1, rollout.bogus=1"
    assert str(caught.value).startswith(f"2 error(s) in {path} with the command line's trainer.lr=-1, rollout.bogus=1")


def test_an_unknown_component_defined_beside_the_config_names_the_plugin_file(tmp_path):
    (tmp_path / "my_gen.py").write_text('class G:\n    name = "my_gen"\n')
    cfg = tmp_path / "c.yaml"
    from tests.conftest import ROOT

    cfg.write_text((ROOT / "examples" / "quickstart.yaml").read_text().replace("generator: single_turn",
                                                                             "generator: my_gen"))
    with pytest.raises(ConfigError) as caught:
        load_config(cfg)
    [error] = [e for e in caught.value.errors if e.startswith("generator")]
    assert error.endswith(f"{tmp_path / 'my_gen.py'} defines it: add `--plugin {tmp_path / 'my_gen.py'}`")


def test_exact_mode_names_each_thing_that_cannot_be_exact_one_line_each(write, plugins):
    base = GOOD.replace("rollout: {rollout_batch_size: 4, n_samples_per_prompt: 4}",
                        "rollout: {rollout_batch_size: 4, n_samples_per_prompt: 4, exact: true, temperature: 0.7, "
                        "engine: {name: sglang}}")
    with pytest.raises(ConfigError) as info:
        load_config(write("c.yaml", base.replace("steps_per_rollout: 2", "steps_per_rollout: 2, backend: {name: fsdp2}")),
                    plugins=plugins)
    errors = [e for e in info.value.errors if e.startswith("rollout.exact")]
    assert any("the sglang engine has no exact mode" in e for e in errors), info.value.errors
    assert any("the fsdp2 trainer has no exact mode" in e for e in errors), info.value.errors
    assert any("needs rollout.temperature 1.0" in e for e in errors), info.value.errors
    assert all("\n" not in e for e in errors)
    local = base.replace(", engine: {name: sglang}", "").replace("temperature: 0.7", "temperature: 1.0")
    with pytest.raises(ConfigError) as info:
        load_config(write("d.yaml", local.replace("steps_per_rollout: 2", "steps_per_rollout: 2, backend: {tp: 2}")),
                    plugins=plugins)
    assert [e for e in info.value.errors if e.startswith("rollout.exact")] == [
        "rollout.exact: needs trainer.backend.tp: 1 (tensor parallelism splits sums over ranks in another order "
        "than the engine's)"], info.value.errors
    cfg = load_config(write("e.yaml", local), plugins=plugins)
    assert cfg.rollout.exact


def test_min_new_tokens_reaches_the_sampling_params(write, plugins):
    cfg = load_config(write("c.yaml", GOOD.replace("n_samples_per_prompt: 4}", "n_samples_per_prompt: 4, "
                                                   "min_new_tokens: 3}")), plugins=plugins)
    assert cfg.rollout.sampling_params().to_sglang()["min_new_tokens"] == 3
    with pytest.raises(ConfigError) as info:
        load_config(write("d.yaml", GOOD.replace("n_samples_per_prompt: 4}", "n_samples_per_prompt: 4, "
                                                 "min_new_tokens: 9, max_new_tokens: 8}")), plugins=plugins)
    assert "rollout.min_new_tokens: 9 exceeds max_new_tokens (8)" in info.value.errors
