"""Every built-in reward of this package keeps the reward contract."""

import pytest

from posttrain.core.plugins import load_plugins
from posttrain.testing.contracts.reward import RewardContract

PLUGINS = load_plugins()
BUILTIN = sorted(n for n in PLUGINS.rewards if (PLUGINS.rewards.provider(n) or None) and
                 PLUGINS.rewards.provider(n).distribution == "posttrain")


class TestBuiltinRewards(RewardContract):
    @pytest.fixture(params=BUILTIN)
    def reward(self, request):
        cls = PLUGINS.rewards[request.param]
        return cls(cls.Config())

    @pytest.fixture
    def component(self, reward):
        return reward


def test_all_built_ins_are_covered():
    assert {"math", "f1", "choice", "regex", "overlong", "length", "remote", "code", "exact_match"} <= set(BUILTIN)
