"""``posttrain.core.interfaces``: the component base, estimator needs as one value, older attributes translated."""

import warnings
from dataclasses import dataclass

import pytest

from posttrain.api import Component, Estimator, EstimatorNeeds, needs_of
from posttrain.core.plugins import load_plugins


class Scaled(Component):
    name = "scaled"

    @dataclass
    class Config:
        scale: float = 1.0


def test_a_component_gets_its_config_or_the_defaults():
    assert Scaled().config == Scaled.Config(scale=1.0)
    given = Scaled.Config(scale=3.0)
    assert Scaled(given).config is given


def test_needs_default_to_nothing_and_are_read_from_the_class_or_an_instance():
    class Plain(Estimator):
        name = "plain"

    class Critic(Estimator):
        name = "critic"
        needs = EstimatorNeeds(critic=True)

    assert needs_of(Plain) == EstimatorNeeds() == Plain.needs
    assert needs_of(Critic()) == EstimatorNeeds(critic=True)
    assert needs_of(type("NoBase", (), {})) == EstimatorNeeds()


def test_older_attributes_are_translated_once_with_a_warning():
    class Legacy:  # a third-party estimator written before EstimatorNeeds
        name = "legacy"
        needs_critic = True
        baseline_sampling = {"temperature": 0.0}

    with pytest.warns(DeprecationWarning, match="legacy.*EstimatorNeeds"):
        assert needs_of(Legacy) == EstimatorNeeds(critic=True, baseline_sampling={"temperature": 0.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # translated once: the class now declares it
        assert Legacy.needs == needs_of(Legacy()) == EstimatorNeeds(critic=True, baseline_sampling={"temperature": 0.0})


def test_older_attributes_on_a_subclass_of_the_base_still_count():
    class Legacy(Estimator):
        name = "legacy_sub"
        needs_teacher = True
        needs_log_probs = True

    with pytest.warns(DeprecationWarning):
        assert needs_of(Legacy) == EstimatorNeeds(log_probs=True, teacher=True)


def test_the_built_ins_declare_what_the_loop_computes_for_them():
    estimators = load_plugins(autoload=False).estimators
    assert estimators["gae"].needs == EstimatorNeeds(critic=True)
    assert estimators["opd"].needs == EstimatorNeeds(log_probs=True, teacher=True)
    assert estimators["remax"].needs.baseline_sampling == {"temperature": 0.0}
    assert estimators["grpo"].needs == EstimatorNeeds()


def test_a_trainer_backend_without_a_checkpoint_format_says_so_in_one_line():
    """``rl-cli models verify / convert`` reach a backend through these; one without them names itself."""
    from posttrain.api import TrainerBackend
    from posttrain.core.errors import UsageError

    class Plain(TrainerBackend):
        name = "plain"

    with pytest.raises(UsageError, match="trainer backend 'plain' cannot verify HF checkpoints"):
        Plain().verify_hf(None, "/nowhere")
    for call in (lambda b: b.checkpoint_from_hf(None, "/a", "/b"), lambda b: b.checkpoint_meta("/a"),
                 lambda b: b.checkpoint_to_hf(None, "/a", "/b", {})):
        with pytest.raises(UsageError, match="trainer backend 'plain' has no checkpoint format"):
            call(Plain())
