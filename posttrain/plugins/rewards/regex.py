"""Format compliance: a regular expression must match the response."""

from __future__ import annotations

import re
from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Component
from posttrain.core.types import Sample


class Regex(Component):
    r"""``match_score`` when ``pattern`` matches the response (``re.search``, or ``re.fullmatch`` with
    ``full_match``; ``.`` matches newlines), else ``miss_score``. E.g. ``pattern: '^<think>.*</think>'``."""

    name = "regex"
    scope = "sample"

    @dataclass
    class Config:
        pattern: str = option(r"<think>.*</think>", help="regular expression the response must match")
        full_match: bool = option(False, help="the whole response must match, not just a part")
        ignore_case: bool = option(False)
        match_score: float = option(1.0)
        miss_score: float = option(0.0)

        def validate(self) -> list[str]:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                return [f"pattern: invalid regular expression {self.pattern!r}: {exc}"]
            return []

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        flags = re.DOTALL | (re.IGNORECASE if self.config.ignore_case else 0)
        self.regex = re.compile(self.config.pattern, flags)

    def __call__(self, sample: Sample) -> float:
        match = (self.regex.fullmatch if self.config.full_match else self.regex.search)(sample.response)
        return self.config.match_score if match else self.config.miss_score


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(Regex)
