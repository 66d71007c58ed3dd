"""The ``teacher:`` section: required by estimators that need a teacher, refused by the others, a path
unless the engines are external, and checked (files, engine options) before anything starts."""

import pytest

from posttrain.core.config import load_config
from posttrain.core.errors import ConfigError
from posttrain.core.plugins import load_plugins

BASE = """
estimator: {name: opd, reward_weight: 0.5}
rollout: {rollout_batch_size: 4, n_samples_per_prompt: 4}
trainer: {global_batch_size: 16, micro_batch_size: 16}
"""


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def _errors(write, text, plugins):
    with pytest.raises(ConfigError) as info:
        load_config(write("c.yaml", text), plugins=plugins)
    return info.value.errors


def test_teacher_section_resolves_relative_to_the_config(write, plugins, tmp_path):
    (tmp_path / "teacher-ckpt").mkdir()
    cfg = load_config(write("c.yaml", BASE + "teacher: {path: teacher-ckpt, num_engines: 2}\n"), plugins=plugins)
    assert cfg.teacher.path == str(tmp_path / "teacher-ckpt") and cfg.teacher.num_engines == 2
    assert cfg.teacher.engine.name == "local"  # the default engine backend
    again = load_config(None, data=cfg.to_dict(), plugins=plugins)
    assert again.to_dict() == cfg.to_dict()


def test_teacher_mistakes_are_reported_before_start(write, plugins):
    assert _errors(write, BASE, plugins) == [
        "teacher: required by estimator 'opd' (a teacher: section with its checkpoint path, or engine: "
        "{name: external, urls: [...]})"]
    assert _errors(write, BASE.replace("opd, reward_weight: 0.5", "grpo") + "teacher: {path: .}\n", plugins) == [
        "teacher: set, but the estimator does not use one (estimators with needs.teacher do)"]
    assert _errors(write, BASE + "teacher: {num_engines: 1}\n", plugins) == [
        "teacher.path: required: the checkpoint the teacher engines serve"]
    assert _errors(write, BASE + "teacher: {path: missing-dir}\n", plugins) == [
        "teacher.path: no such file or directory: missing-dir"]
    errors = _errors(write, BASE + "teacher: {path: ., engine: {name: local, device: gpu}}\n", plugins)
    assert errors == ["teacher.engine.device: expected cpu, cuda or cuda:N, got 'gpu'"]


def test_external_teacher_needs_no_path(write, plugins):
    cfg = load_config(write("c.yaml", BASE + "teacher: {engine: {name: external, urls: ['http://t:1'], "
                                             "device: cpu}}\n"), plugins=plugins)
    assert cfg.teacher.path is None and cfg.teacher.engine.create().urls() == ["http://t:1"]


@pytest.mark.parametrize("trainer_gpus, device, first", [(0, "cpu", True), (1, "cuda:1", True), (1, "cuda", True),
                                                         (1, "cuda:0", False), (2, "cuda:1", False)])
def test_the_teacher_starts_with_the_run_unless_it_takes_a_trainer_gpu(write, plugins, tmp_path, trainer_gpus,
                                                                       device, first):
    """``launch_teacher``: a teacher whose engines take none of the trainer's GPUs is launched before the trainer
    builds; one on a trainer GPU (``cuda:0`` beside one trainer GPU) is left to ``open_teacher``, after the
    trainer, as it was."""
    from posttrain.core.rollout.teacher import launch_teacher

    (tmp_path / "teacher-ckpt").mkdir()
    cfg = load_config(write("c.yaml", BASE + f"teacher: {{path: teacher-ckpt, engine: {{name: local, device: {device}}}}}"
                            f"\nresources: {{trainer_gpus_per_node: {trainer_gpus}, rollout_gpus: 1}}\n"),
                      plugins=plugins)
    launched = []

    class Executor:
        def teacher(self, log_dir):
            launched.append(log_dir)
            return "role"

    assert launch_teacher(cfg, plugins, Executor(), "logs") == ("role" if first else None)
    assert launched == (["logs"] if first else [])
