"""Each estimator and loss actually learns: a tiny token bandit trained end to end with the real pieces.

The "policy" is a table of logits ``theta [T, V]`` (one categorical per response position); a response
is ``T`` tokens sampled from it, and its reward is the fraction of tokens equal to ``TARGET``. A uniform
policy scores 1/V = 0.25 on average; after a few dozen RL steps every combination should score > 0.8.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.core.losses import batch_counts, value_loss
from posttrain.core.plugins import load_plugins
from posttrain.core.types import AdvantageBatch

PLUGINS = load_plugins(autoload=False)  # posttrain's own: a third-party plugin installed changes nothing
T, V, TARGET = 4, 4, 2
GROUPS, PER_GROUP = 8, 8


def reward_of(tokens: torch.Tensor) -> torch.Tensor:
    return (tokens == TARGET).float().mean(-1)


def train(estimator_name: str, loss_name: str, steps: int = 40, **loss_config) -> float:
    torch.manual_seed(0)
    est_cls, loss_cls = PLUGINS.estimators[estimator_name], PLUGINS.losses[loss_name]
    estimator, loss_fn = est_cls(est_cls.Config()), loss_cls(loss_cls.Config(**loss_config))
    theta = torch.zeros(T, V, requires_grad=True)
    critic = torch.zeros(T, requires_grad=True)
    opt = torch.optim.Adam([theta, critic], lr=0.1)
    b = GROUPS * PER_GROUP
    mask = torch.ones(b, T)
    group_index = torch.arange(b) // PER_GROUP
    for _ in range(steps):
        with torch.no_grad():
            tokens = torch.distributions.Categorical(logits=theta).sample((b,))  # [B, T]
            old = torch.log_softmax(theta, -1)[torch.arange(T), tokens]
            greedy = reward_of(theta.argmax(-1)).expand(b)
            old_values = critic.detach().expand(b, T).clone()
        batch = AdvantageBatch(rewards=reward_of(tokens), group_index=group_index, response_mask=mask,
                               values=old_values, metadata={"baseline_rewards": greedy})
        advantages, returns = estimator.advantages(batch)
        tokens_n, seqs_n = batch_counts(mask)
        for _ in range(2):  # two optimizer steps per rollout, each over two micro-batches
            opt.zero_grad()
            for rows in (slice(0, b // 2), slice(b // 2, b)):
                lp = torch.log_softmax(theta, -1)[torch.arange(T), tokens[rows]]
                loss, _ = loss_fn(lp, old[rows], advantages[rows], mask[rows], global_tokens=tokens_n,
                                  global_seqs=seqs_n)
                if estimator.needs.critic:
                    vf, _ = value_loss(critic.expand(b, T)[rows], old_values[rows], returns[rows], mask[rows],
                                       global_tokens=tokens_n)
                    loss = loss + 0.5 * vf
                loss.backward()
            opt.step()
    with torch.no_grad():
        return float(reward_of(torch.distributions.Categorical(logits=theta).sample((512,))).mean())


@pytest.mark.parametrize("estimator", sorted(n for n, c in PLUGINS.estimators.items()
                                              if not c.needs.teacher))  # opd: test_opd.py
def test_every_estimator_learns_with_ppo_clip(estimator):
    assert train(estimator, "ppo_clip") > 0.8


@pytest.mark.parametrize("loss, config", [("gspo", {}), ("cispo", {}), ("gmpo", {}), ("reinforce", {}),
                                          ("ppo_clip", {"dual_clip": 3.0}),
                                          ("ppo_clip", {"aggregation": "seq-mean-token-sum-norm"})])
def test_every_loss_learns_with_grpo(loss, config):
    assert train("grpo", loss, **config) > 0.8
