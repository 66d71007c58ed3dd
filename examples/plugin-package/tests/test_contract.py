import pytest

from posttrain.core.types import Sample
from posttrain.testing import EstimatorContract, RewardContract
from posttrain_example.keyword_reward import KeywordReward
from posttrain_example.signed_estimator import SignedAdvantage


class TestKeywordReward(RewardContract):
    @pytest.fixture
    def reward(self):
        return KeywordReward(KeywordReward.Config(keywords=["paris", "france"]))

    @pytest.fixture
    def reward_cases(self):
        return [(Sample(prompt="q", response="Paris is in France", label=None), 1.0),
                (Sample(prompt="q", response="Paris", label=None), 0.5),
                (Sample(prompt="q", response="Berlin", label=None), 0.0)]


class TestSignedAdvantage(EstimatorContract):
    @pytest.fixture
    def estimator(self):
        return SignedAdvantage(SignedAdvantage.Config(scale=2.0))
