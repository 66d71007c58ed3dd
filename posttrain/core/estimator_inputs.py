"""What an estimator may ask the loop for beyond rewards, declared on the estimator class as one value,
``needs = EstimatorNeeds(...)`` (:class:`posttrain.core.interfaces.EstimatorNeeds`).

- ``critic=True``: critic values ``[B, T]`` (the trainer backend builds a critic role).
- ``teacher=True``: the teacher's log-probs of every response token, ``metadata["teacher_log_probs"]``
  ``[B, T]`` (aligned like ``response_mask``), from the run's ``teacher:`` fleet
  (``posttrain.core.rollout.teacher``); the policy's own are ``AdvantageBatch.log_probs``.
- ``metrics``: a ``dict[str, float]`` an estimator may fill in ``advantages()``; logged as ``estimator/<key>``.
- ``baseline_sampling={...}``: sampling overrides for one extra sample per prompt (ReMax:
  ``{"temperature": 0.0}``, the greedy response). The loop generates it with the run's generator, scores
  it with the run's rewards, and hands its reward to the estimator as ``metadata["baseline_rewards"]``
  (``[B]``, the baseline of each sample's prompt). Baseline samples are never trained on.

The loop calls :func:`add_baseline` (and the teacher's scoring) per group, :func:`estimator_metadata` per
batch and :func:`estimator_metrics` per step, so a new estimator that declares these gets them without
a loop change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from posttrain.core.interfaces import needs_of
from posttrain.core.types import Sample

BASELINE_KEY = "baseline_reward"  # per-sample metadata key; the batch key is "baseline_rewards"


async def add_baseline(group: list[Sample], estimator: Any, generator: Any, engine: Any, sampling: Any,
                       rewards: Any) -> None:
    """For an estimator whose ``needs.baseline_sampling`` is set: generate and score one sample of ``group``'s prompt
    with those overrides, and write its reward into every sample's ``metadata["baseline_reward"]``. A
    baseline whose reward failed counts as 0 (its error is kept in ``metadata["baseline_error"]``)."""
    overrides = needs_of(estimator).baseline_sampling
    if not overrides or not group:
        return
    first = group[0]
    probe = Sample(prompt=first.prompt, label=first.label, metadata=dict(first.metadata),
                   tokens=list(first.tokens[:first.prompt_length]), group_index=first.group_index, index=first.index)
    [probe] = (await generator([probe], engine, dataclasses.replace(sampling, **overrides)))[:1]
    await rewards.score_groups([[probe]])
    for s in group:
        s.metadata[BASELINE_KEY] = float(probe.reward) if probe.reward is not None else 0.0
        if probe.error:
            s.metadata["baseline_error"] = probe.error


def estimator_metadata(samples: list[Sample]) -> dict[str, Any]:
    """``AdvantageBatch.metadata`` for ``samples``: ``baseline_rewards`` ``[B]`` and ``teacher_log_probs``
    ``[B, T]`` (``T`` the batch's padded length, response columns only) when every sample has them."""
    import torch

    from posttrain.core.rollout.teacher import TEACHER_KEY

    out: dict[str, Any] = {}
    if samples and all(BASELINE_KEY in s.metadata for s in samples):
        out["baseline_rewards"] = torch.tensor([s.metadata[BASELINE_KEY] for s in samples])
    if samples and all(TEACHER_KEY in s.metadata for s in samples):
        teacher = torch.zeros(len(samples), max(len(s.tokens) for s in samples))
        for i, s in enumerate(samples):
            teacher[i, s.prompt_length:len(s.tokens)] = torch.tensor(s.metadata[TEACHER_KEY])
        out[TEACHER_KEY] = teacher
    return out


def estimator_metrics(estimator: Any) -> dict[str, float]:
    """What the estimator reported about its last ``advantages()`` call, as ``estimator/<key>``."""
    return {f"estimator/{k}": float(v) for k, v in (getattr(estimator, "metrics", None) or {}).items()}
