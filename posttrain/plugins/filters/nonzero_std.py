"""DAPO's dynamic-sampling filter: drop groups whose rewards are all equal (zero advantage for all)."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Component
from posttrain.core.types import Sample


class NonzeroStd(Component):
    """Keep a group only if the (population) standard deviation of its rewards exceeds ``min_std``.

    A group whose samples all scored the same gives every sample a zero GRPO advantage, so it costs
    a training step and teaches nothing. Failed samples (``reward is None``) are ignored. Drop
    reasons: ``too_few_scored`` (fewer than two scored samples), ``all_correct`` (equal rewards, all
    > 0) and ``all_wrong`` (equal rewards, all <= 0): both of the last are DAPO's zero-std case, split
    so the metrics show which end of the difficulty range is being discarded.
    """

    name = "nonzero_std"

    @dataclass
    class Config:
        min_std: float = option(0.0, ge=0.0, help="keep groups whose reward std is strictly above this")

    def __call__(self, group: list[Sample]) -> str | None:
        rewards = [s.reward for s in group if s.reward is not None]
        if len(rewards) < 2:
            return "too_few_scored"
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        if std > self.config.min_std:
            return None
        return "all_correct" if min(rewards) > 0 else "all_wrong"


@hookimpl
def posttrain_register_filters(registry):
    registry.add(NonzeroStd)
