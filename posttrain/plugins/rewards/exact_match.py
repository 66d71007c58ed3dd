"""Exact match of the response (after light normalization) against the label."""

from __future__ import annotations

import re
from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Component
from posttrain.core.types import Sample


class ExactMatch(Component):
    """1.0 when the normalized response equals the normalized label, else 0.0.

    Normalization: text after the last ``think_end`` marker (if set), surrounding whitespace removed,
    inner runs of whitespace collapsed, optionally lower-cased. Returns
    ``{"score": 1.0 | 0.0}``.
    """

    name = "exact_match"
    scope = "sample"

    @dataclass
    class Config:
        ignore_case: bool = option(False, help="compare case-insensitively")
        think_end: str | None = option(None, help="score only the text after the last occurrence of this marker")

    def normalize(self, text: str) -> str:
        if self.config.think_end and self.config.think_end in text:
            text = text.rsplit(self.config.think_end, 1)[1]
        text = re.sub(r"\s+", " ", text.strip())
        return text.lower() if self.config.ignore_case else text

    def __call__(self, sample: Sample) -> dict[str, float]:
        if sample.label is None:
            raise ValueError("exact_match needs a label")
        return {"score": float(self.normalize(sample.response) == self.normalize(str(sample.label)))}


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(ExactMatch)
