"""The agent_reward reward: the float an agent returned, or a failure naming why there is none."""

import pytest

from posttrain.core.types import Sample
from posttrain.plugins.rewards.agent_reward import AgentReward


def test_reads_the_agents_float_and_refuses_a_missing_one():
    assert AgentReward()(Sample(prompt="p", metadata={"agent_reward": 0.5})) == 0.5
    with pytest.raises(ValueError, match="returned no reward"):
        AgentReward()(Sample(prompt="p"))
