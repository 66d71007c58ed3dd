"""The typed interface of every plugin kind, in one place: what a ``posttrain_register_*`` hook's components are.

Write a component against these and ``posttrain.testing``'s contract suite for its kind checks the behaviour
behind the types::

    from posttrain import hookimpl
    from posttrain.api import Estimator, EstimatorNeeds

    class MyEstimator(Estimator):
        name = "mine"
        needs = EstimatorNeeds(critic=True)  # the loop computes critic values for it
        ...

Kinds whose contract is a call (losses, corrections, rewards, filters, generators, tools, agents) are
runtime-checkable Protocols: a plain class (or a registered function) satisfies them. Kinds with more to
them are base classes to subclass: :class:`Estimator`, :class:`ModelSpec`, :class:`EngineBackend`,
:class:`TrainerBackend`, :class:`RunMode`; :class:`PolicyLoss` implements :class:`Loss` with shape checks,
importance weights and aggregation. :class:`Component` is the ``name`` + ``Config`` + ``__init__(config=None)``
every component shares. :data:`INTERFACES` maps each registry kind to its type.
"""

from __future__ import annotations

from posttrain.core.interfaces import (Agent, Component, Correction, Estimator, EstimatorNeeds, Filter, Finding,
                                       Generator, Loss, Reward, Tool, needs_of)
from posttrain.core.losses import PolicyLoss
from posttrain.core.model_spec import ModelSpec
from posttrain.core.rollout.backend import EngineBackend, EngineLaunch, EngineSlot
from posttrain.core.run_mode import RunMode
from posttrain.core.trainer_backend import TrainerBackend

# registry kind (``posttrain.core.registry.KINDS``) -> the type its components satisfy: ``issubclass`` for the
# base classes, ``isinstance`` of an instance for the Protocols
INTERFACES: dict[str, type] = {
    "estimators": Estimator,
    "losses": Loss,
    "corrections": Correction,
    "rewards": Reward,
    "generators": Generator,
    "models": ModelSpec,
    "filters": Filter,
    "tools": Tool,
    "agents": Agent,
    "engines": EngineBackend,
    "trainers": TrainerBackend,
    "modes": RunMode,
}

__all__ = ["INTERFACES", "Agent", "Component", "Correction", "EngineBackend", "EngineLaunch", "EngineSlot", "Estimator",
           "EstimatorNeeds", "Filter", "Finding", "Generator", "Loss", "ModelSpec", "PolicyLoss", "Reward", "RunMode",
           "Tool", "TrainerBackend", "needs_of"]
