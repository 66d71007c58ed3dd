"""A penalty per response token beyond a free allowance."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Component
from posttrain.core.types import Sample


class Length(Component):
    r"""``r = -per_token * max(0, L - free_tokens)``, optionally floored at ``-max_penalty``;
    ``L = sample.response_length`` (tokens)."""

    name = "length"
    scope = "sample"

    @dataclass
    class Config:
        per_token: float = option(0.001, ge=0.0, help="penalty per response token")
        free_tokens: int = option(0, ge=0, help="tokens that cost nothing")
        max_penalty: float | None = option(None, ge=0.0, help="the penalty never exceeds this")

    def __call__(self, sample: Sample) -> float:
        c = self.config
        penalty = c.per_token * max(0, sample.response_length - c.free_tokens)
        if c.max_penalty is not None:
            penalty = min(penalty, c.max_penalty)
        return -penalty


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(Length)
