"""The generator contract: generic checks, plus a real rollout against a local engine server.

Subclass :class:`GeneratorContract` and supply a ``generator`` fixture. The contract starts the embedded
local engine (``rl-cli engine serve``) over a tiny random Qwen3 checkpoint in a subprocess on a free
loopback port, once per test class, and runs the generator on a small group through it.
"""

from __future__ import annotations

import pytest

from posttrain.testing.contracts.common import ComponentContract


class GeneratorContract(ComponentContract):
    """Supply a ``generator`` fixture."""

    @pytest.fixture
    def component(self, generator):
        return generator

    def test_is_async_callable(self, generator):
        import inspect

        assert inspect.iscoroutinefunction(type(generator).__call__), "generators are `async def __call__`"

    @pytest.fixture(scope="class")
    @classmethod
    def local_engine(cls, tmp_path_factory):
        from posttrain.testing.engine import start_local_engine
        from posttrain.testing.tiny import make_tiny_checkpoint

        ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("generator_contract") / "qwen3")
        server = start_local_engine(ckpt, context_length=512)
        yield server
        server.stop()

    def test_rolls_out_a_group_through_a_local_engine(self, generator, local_engine):
        import asyncio

        from posttrain.core.rollout.client import EngineClient
        from posttrain.core.types import Sample, SampleStatus, SamplingParams

        async def run():
            async with EngineClient(local_engine.base_url, api_key=local_engine.api_key) as engine:
                group = [Sample(prompt="1+1=", group_index=7, index=i) for i in range(2)]
                return await generator(group, engine, SamplingParams(temperature=1.0, max_new_tokens=16))

        out = asyncio.run(run())
        assert isinstance(out, list) and len(out) >= 2, "a generator returns at least the samples it got"
        for s in out:
            assert s.group_index == 7, "fan-out keeps group_index"
            assert s.status is not SampleStatus.PENDING, "every returned sample has a final status"
            assert 0 < s.response_length <= len(s.tokens)
            assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs), \
                "loss_mask and rollout_log_probs cover the response exactly"
            assert set(s.loss_mask) <= {0, 1} and s.loss_mask[0] == 1, "the response starts with model tokens"
            assert all(lp <= 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m), "log-probs are <= 0"
