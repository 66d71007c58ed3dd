"""The interface of each plugin kind that has no base class elsewhere, and what every component shares.

A component is a class with a ``name``, a nested dataclass ``Config`` and ``__init__(config=None)``;
:class:`Component` gives the last for free. Kinds whose contract is a call (losses, corrections, rewards,
filters, generators, tools, agents) are :func:`~typing.runtime_checkable` Protocols, so a plain class or a
registered function satisfies them without inheriting anything; estimators declare what the loop must
compute for them as one value, :class:`EstimatorNeeds`. ``posttrain.api`` gathers these with the base
classes of the other kinds (model specs, engine and trainer backends, run modes).

Nothing here imports torch: core modules read these types before any model is built.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor

    from posttrain.core.types import AdvantageBatch, Sample

ConfigT = TypeVar("ConfigT")


class Component(Generic[ConfigT]):
    """A named, configured component: ``Cls(Cls.Config(...))``, or ``Cls()`` for the defaults.

    Subclasses set ``name`` and nest their own ``@dataclass class Config``; ``self.config`` is the one
    given, else ``Config()`` with every default.
    """

    name: ClassVar[str] = ""

    @dataclass
    class Config:
        pass

    def __init__(self, config: ConfigT | None = None):
        self.config: ConfigT = config if config is not None else self.Config()


@dataclass(frozen=True)
class EstimatorNeeds:
    """What the loop computes for an estimator beyond rewards (all off by default).

    - ``critic``: critic values ``AdvantageBatch.values [B, T]``; the trainer backend builds a critic role.
    - ``log_probs``: the old policy's log-probs ``AdvantageBatch.log_probs [B, T]`` before the estimator
      runs (otherwise the loop may take them from the train step's forward and pass None).
    - ``teacher``: a teacher's log-probs of every response token, ``metadata["teacher_log_probs"]``
      (the run config's ``teacher`` section; implies the old policy's log-probs too).
    - ``baseline_sampling``: sampling overrides for one extra sample per prompt, generated and scored
      before the estimator runs (ReMax's greedy baseline: ``{"temperature": 0.0}``); None: no extra sample.
    """

    critic: bool = False
    log_probs: bool = False
    teacher: bool = False
    baseline_sampling: Mapping[str, Any] | None = None


class Estimator(Component[ConfigT]):
    """Advantage estimator: ``advantages(batch) -> (advantages, returns)``, both ``[B, T]`` float tensors
    that are exactly 0 where ``batch.response_mask`` is 0. ``needs`` declares the loop's extra work."""

    needs: ClassVar[EstimatorNeeds] = EstimatorNeeds()

    def advantages(self, batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
        raise NotImplementedError(f"estimator {self.name!r} does not implement advantages(batch)")


# the attribute names estimators set before EstimatorNeeds, and the field each one became
_LEGACY_NEEDS = {"needs_critic": "critic", "needs_log_probs": "log_probs", "needs_teacher": "teacher",
                 "baseline_sampling": "baseline_sampling"}


def needs_of(estimator: Any) -> EstimatorNeeds:
    """The :class:`EstimatorNeeds` of an estimator class or instance.

    A class that declares ``needs`` (itself or a base other than :class:`Estimator`) gets it. A class that
    still sets the older attributes (``needs_critic``, ``needs_log_probs``, ``needs_teacher``,
    ``baseline_sampling``) gets them translated, with a DeprecationWarning, and the result is stored as its
    ``needs`` so the translation happens once per class.
    """
    cls = estimator if isinstance(estimator, type) else type(estimator)
    for klass in cls.__mro__:
        if klass is Estimator:
            break
        declared = klass.__dict__.get("needs")
        if isinstance(declared, EstimatorNeeds):
            return declared
    legacy = {field: getattr(cls, attr) for attr, field in _LEGACY_NEEDS.items() if hasattr(cls, attr)}
    if not legacy:
        return EstimatorNeeds()
    needs = EstimatorNeeds(**legacy)
    warnings.warn(f"estimator {getattr(cls, 'name', cls.__name__)!r} ({cls.__module__}): declare "
                  f"`needs = {needs!r}` (posttrain.api.EstimatorNeeds) instead of {', '.join(_LEGACY_NEEDS)}",
                  DeprecationWarning, stacklevel=2)
    cls.needs = needs
    return needs


@runtime_checkable
class Loss(Protocol):
    """Policy loss over ``[B, T]`` tensors: ``(loss, metrics)``, a scalar with gradient and a dict of floats
    (at least ``clipfrac``, ``approx_kl``, ``ratio_mean``). ``global_tokens`` / ``global_seqs`` are the whole
    batch's counts, so micro-batch losses sum to the full-batch loss. ``posttrain.core.losses.PolicyLoss``
    implements it."""

    def __call__(self, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, response_mask: Tensor,
                 is_weights: Tensor | None = None, global_tokens: float | None = None,
                 global_seqs: float | None = None) -> tuple[Tensor, dict[str, float]]: ...


@runtime_checkable
class Correction(Protocol):
    """Rollout/training mismatch correction: ``(is_weights [B, T], metrics)`` from the train and rollout
    log-probs ``[B, T]``; the loss multiplies its per-token terms by ``is_weights``."""

    def __call__(self, train_log_probs: Tensor, rollout_log_probs: Tensor,
                 response_mask: Tensor) -> tuple[Tensor, dict[str, float]]: ...


@runtime_checkable
class Reward(Protocol):
    """Reward: called with one ``Sample`` (``scope = "sample"``, the default) or a group ``list[Sample]``
    (``scope = "group"``); returns a float or a dict of floats with ``"score"`` (a group reward: one per
    sample). ``async def __call__`` is allowed."""

    def __call__(self, sample: Any) -> Any: ...


@runtime_checkable
class Filter(Protocol):
    """Dynamic-sampling filter: ``None`` keeps a rewarded group, a short reason string drops it."""

    def __call__(self, group: list[Sample]) -> str | None: ...


@runtime_checkable
class Generator(Protocol):
    """Rollout generator: ``await generator(group, engine, sampling) -> list[Sample]`` (may fan out; each
    request's ``sampling_params`` come from ``sampling.for_sample`` or ``sampling.for_group``)."""

    def __call__(self, group: list[Sample], engine: Any, sampling: Any) -> Any: ...


@runtime_checkable
class Tool(Protocol):
    """Tool of multi-turn generators: the call's JSON arguments as keywords, a string for the model (sync or
    async)."""

    def __call__(self, **arguments: Any) -> Any: ...


@runtime_checkable
class Agent(Protocol):
    """Agent of the ``openai_agent`` generator: ``await agent(base_url, api_key, sample) -> str | float``.

    It talks to an OpenAI-compatible endpoint at ``base_url`` (``.../v1``, bound to this one sample) with
    ``api_key``, through any OpenAI-compatible client, runs its own tools, and returns its final answer (the
    run's rewards score it as ``sample.response``) or a float (the sample's reward, read by the
    ``agent_reward`` reward)."""

    def __call__(self, base_url: str, api_key: str, sample: Sample) -> Any: ...


@dataclass
class Finding:
    """One line of ``rl-cli doctor``: ``ok`` / ``FAIL`` / ``note`` (neither a pass nor a failure), an area
    (``sandbox``, ``gpus``, ...) and a message. Plugins return these from ``posttrain_doctor_checks``."""

    ok: bool
    area: str
    message: str
    note: bool = False

    def line(self) -> str:
        tag = "note" if self.note else ("ok  " if self.ok else "FAIL")
        return f"{tag} {self.area}: {self.message}"

