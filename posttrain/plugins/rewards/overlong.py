"""DAPO's soft overlong punishment: a linear penalty over the last ``buffer`` tokens before ``max_len``."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Component
from posttrain.core.types import Sample


class Overlong(Component):
    r"""With ``L`` the response length in tokens, ``M = max_len``, ``B = buffer`` (DAPO eq. 13)::

        r = 0                      if L <= M - B
        r = ((M - B) - L) / B      if M - B < L <= M
        r = -1                     if L > M

    times ``penalty_factor``. Meant to be added (weight 1) to a correctness reward. ``L`` is
    ``sample.response_length``; DAPO uses the generation cap as ``M``.
    """

    name = "overlong"
    scope = "sample"

    @dataclass
    class Config:
        max_len: int = option(4096, ge=1, help="length (tokens) at which the penalty reaches -1")
        buffer: int = option(512, ge=1, help="tokens before max_len over which the penalty ramps up")
        penalty_factor: float = option(1.0, ge=0.0)

        def validate(self) -> list[str]:
            if self.buffer > self.max_len:
                return [f"buffer: {self.buffer} exceeds max_len {self.max_len}"]
            return []

    def __call__(self, sample: Sample) -> float:
        c = self.config
        length, start = sample.response_length, c.max_len - c.buffer
        if length <= start:
            return 0.0
        if length <= c.max_len:
            return c.penalty_factor * (start - length) / c.buffer
        return -c.penalty_factor


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(Overlong)
