"""The ``agent_reward`` reward: the float an ``openai_agent`` agent returned."""

from __future__ import annotations

from posttrain import hookimpl
from posttrain.api import Component
from posttrain.core.types import Sample


class AgentReward(Component):
    """``r = sample.metadata["agent_reward"]``: the reward the agent computed itself (it returned a float instead
    of an answer). A sample without one is a reward failure (the agent returned a string: score it with
    another reward)."""

    name = "agent_reward"
    scope = "sample"

    @staticmethod
    def contract_cases() -> list[tuple[Sample, float]]:
        """Samples as ``openai_agent`` leaves them when its agent returned a float."""
        return [(Sample(prompt="2+3=", response="5", label="5", metadata={"agent_reward": r}), r) for r in (0.75, 0.0)]

    def __call__(self, sample: Sample) -> float:
        if "agent_reward" not in sample.metadata:
            raise ValueError("the agent returned no reward (a string answer: use another reward to score it)")
        return float(sample.metadata["agent_reward"])


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(AgentReward)
