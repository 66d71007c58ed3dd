"""The long-tail task of ``bench/long_tail.py`` (a single-file plugin: ``rl-cli run --plugin``).

The quickstart's ``a+b=`` prompts, answered by the first character of the response, and a response-length
distribution with a long tail, as agentic or long chain-of-thought rollouts have: the ``long_tail``
generator gives each sample a token budget of ``short`` tokens, or with probability ``long_frac`` the
run's whole ``max_new_tokens`` (a hash of the sample's index decides, so every mode draws the same
lengths), and generates exactly that many (``ignore_eos``). The ``label_prefix`` reward is 1 when the
response starts with the label.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from posttrain import hookimpl, option


class LongTail:
    """``single_turn`` per sample, each with its own budget: ``short`` tokens, or ``max_new_tokens``
    for a ``long_frac`` of the samples."""

    name = "long_tail"

    @dataclass
    class Config:
        short: int = option(4, ge=1, help="tokens of most responses")
        long_frac: float = option(0.1, ge=0.0, le=1.0, help="fraction of responses that run to max_new_tokens")

    def __init__(self, config=None):
        self.config = config or self.Config()

    def budget(self, sample, max_new_tokens: int) -> int:
        u = int.from_bytes(hashlib.blake2b(str(sample.index).encode(), digest_size=4).digest(), "little") / 2**32
        return max_new_tokens if u < self.config.long_frac else min(self.config.short, max_new_tokens)

    async def __call__(self, group, engine, sampling):
        import asyncio

        from posttrain.plugins.generators.single_turn import SingleTurn

        one = SingleTurn(SingleTurn.Config(chat_template=False, batch_group=False))

        async def run(sample):
            params = dataclasses.replace(sampling, max_new_tokens=self.budget(sample, sampling.max_new_tokens),
                                         extra={**sampling.extra, "ignore_eos": True})
            return (await one([sample], engine, params))[0]

        return list(await asyncio.gather(*[run(s) for s in group]))


class LabelPrefix:
    """1.0 when the response starts with the label, else 0.0."""

    name = "label_prefix"
    scope = "sample"

    def __init__(self, config=None):
        self.config = config

    def __call__(self, sample):
        return {"score": float(sample.response.startswith(str(sample.label)))}


@hookimpl
def posttrain_register_generators(registry):
    registry.add(LongTail)


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(LabelPrefix)
