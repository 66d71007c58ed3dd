"""Every estimator against tensors derived by hand (see the comments for the arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.plugins import load_plugins
from posttrain.core.types import AdvantageBatch

PLUGINS = load_plugins(autoload=False)  # posttrain's own: a third-party plugin installed changes nothing
S2 = math.sqrt(2.0)


def est(name, **config):
    cls = PLUGINS.estimators[name]
    return cls(cls.Config(**config))


def mask_of(lengths, t=4):
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()


def broadcast(scores, mask):
    return torch.tensor(scores, dtype=torch.float32)[:, None] * mask


@pytest.fixture
def batch():
    # groups by id (interleaved): 7 -> samples 0, 2 (r 1, 3); 9 -> samples 1, 3 (r 2, 0.5); 4 -> sample 4 alone.
    # sample 3 has no response tokens (length 0).
    return AdvantageBatch(rewards=torch.tensor([1.0, 2.0, 3.0, 0.5, 4.0]),
                          group_index=torch.tensor([7, 9, 7, 9, 4]),
                          response_mask=mask_of([3, 1, 2, 0, 4]))


def test_grpo_hand_derived(batch):
    # group 7: mean 2, std sqrt(((1-2)^2 + (3-2)^2) / 1) = sqrt2 -> -1/sqrt2, +1/sqrt2
    # group 9: mean 1.25, std sqrt(2 * 0.75^2) = 0.75 sqrt2 -> +1/sqrt2, -1/sqrt2; group 4 alone: raw 4
    eps = 1e-6
    expected = [-1 / (S2 + eps), 0.75 / (0.75 * S2 + eps), 1 / (S2 + eps), -0.75 / (0.75 * S2 + eps), 4 / (1 + eps)]
    adv, ret = est("grpo").advantages(batch)
    torch.testing.assert_close(adv, broadcast(expected, batch.response_mask))
    torch.testing.assert_close(ret, adv)


def test_grpo_without_std_and_epsilon(batch):
    adv, _ = est("grpo", normalize_std=False).advantages(batch)
    torch.testing.assert_close(adv, broadcast([-1.0, 0.75, 1.0, -0.75, 4.0], batch.response_mask))
    adv, _ = est("grpo", epsilon=1.0).advantages(batch)
    torch.testing.assert_close(adv[0, 0], torch.tensor(-1 / (S2 + 1)))


def test_grpo_pass_k_hand_derived():
    # group 0: 1 correct of 4, k = 2: p = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2; the correct sample
    # (1 - p) / sigma = 1; a wrong one (1 - p - C(2,1)/C(3,1)) / sigma = -1/3.
    # group 1: 2 of 4, k = 2: p = 1 - C(2,2)/C(4,2) = 5/6, sigma = sqrt(5)/6; correct (1/6) / sigma = 1/sqrt5,
    # wrong (1/6 - C(1,1)/C(3,1)) / sigma = -1/sqrt5. Sample 8 alone keeps its reward.
    b = AdvantageBatch(rewards=torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.7]),
                       group_index=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2]), response_mask=mask_of([2] * 9))
    adv, ret = est("grpo", pass_k=2, epsilon=1e-12).advantages(b)
    s5 = 1 / math.sqrt(5)
    torch.testing.assert_close(adv, broadcast([-1 / 3, 1.0, -1 / 3, -1 / 3, s5, -s5, s5, -s5, 0.7], b.response_mask))
    torch.testing.assert_close(ret, adv)
    # against plain GRPO (k = 1: -0.25 / 0.5): the wrong samples of group 0 are pushed down less
    k1, _ = est("grpo", epsilon=1e-12).advantages(b)
    assert (adv[[0, 2, 3], 0] > k1[[0, 2, 3], 0]).all()
    unnormalized, _ = est("grpo", pass_k=2, normalize_std=False).advantages(b)
    torch.testing.assert_close(unnormalized[:4, 0], torch.tensor([-1 / 6, 1 / 2, -1 / 6, -1 / 6]))


def test_grpo_pass_k_of_a_group_no_larger_than_k_is_zero():
    b = AdvantageBatch(rewards=torch.tensor([1.0, 0.0, 0.0]), group_index=torch.tensor([0, 0, 0]),
                       response_mask=mask_of([1, 1, 1]))
    adv, _ = est("grpo", pass_k=3).advantages(b)
    assert adv.abs().max() == 0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk",
                                  "reinforce_plus_plus_baseline"])
def test_all_equal_rewards_in_every_group_give_zero(name):
    b = AdvantageBatch(rewards=torch.tensor([0.7, 0.7, 0.7, -2.0, -2.0]),
                       group_index=torch.tensor([0, 0, 0, 1, 1]), response_mask=mask_of([4, 3, 2, 1, 4]))
    adv, _ = est(name).advantages(b)
    torch.testing.assert_close(adv, torch.zeros_like(adv), atol=1e-6, rtol=0)  # float rounding of the mean


def test_grpo_token_rewards_sum_into_the_score():
    # scores: 1 + (0.5 + 0.5) = 2 and 0 + 0 = 0 -> mean 1, std sqrt2 -> +-1/sqrt2
    mask = mask_of([2, 1], t=2)
    b = AdvantageBatch(rewards=torch.tensor([1.0, 0.0]), group_index=torch.tensor([0, 0]), response_mask=mask,
                       token_rewards=torch.tensor([[0.5, 0.5], [0.0, 9.0]]))  # 9.0 is padding: ignored
    adv, _ = est("grpo", epsilon=1e-12).advantages(b)
    torch.testing.assert_close(adv, broadcast([1 / S2, -1 / S2], mask))


def test_dr_grpo_hand_derived(batch):
    adv, ret = est("dr_grpo").advantages(batch)
    torch.testing.assert_close(adv, broadcast([-1.0, 0.75, 1.0, -0.75, 4.0], batch.response_mask))
    torch.testing.assert_close(ret, adv)


def test_rloo_hand_derived(batch):
    # pairs: r_i - r_other; alone: raw
    adv, _ = est("rloo").advantages(batch)
    torch.testing.assert_close(adv, broadcast([-2.0, 1.5, 2.0, -1.5, 4.0], batch.response_mask))
    # a group of three, rewards 1, 2, 6: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5
    b = AdvantageBatch(rewards=torch.tensor([1.0, 2.0, 6.0]), group_index=torch.tensor([5, 5, 5]),
                       response_mask=mask_of([1, 2, 3], t=3))
    adv, _ = est("rloo").advantages(b)
    torch.testing.assert_close(adv, broadcast([-3.0, -1.5, 4.5], b.response_mask))


def test_opo_length_weighted_baseline(batch):
    # group 7: lengths 3, 2 -> b = (3*1 + 2*3) / 5 = 1.8 -> -0.8, 1.2
    # group 9: lengths 1, 0 -> b = (1*2 + 0*0.5) / 1 = 2 -> 0 (sample 3 has no tokens); group 4 alone: b = 0
    adv, _ = est("opo").advantages(batch)
    torch.testing.assert_close(adv, broadcast([-0.8, 0.0, 1.2, 0.0, 4.0], batch.response_mask))


def test_remax_greedy_baseline(batch):
    batch.metadata["baseline_rewards"] = torch.tensor([0.5, 0.5, 1.0, 1.0, 2.0])
    adv, _ = est("remax").advantages(batch)
    torch.testing.assert_close(adv, broadcast([0.5, 1.5, 2.0, -0.5, 2.0], batch.response_mask))


def test_remax_without_baseline_says_what_is_missing(batch):
    with pytest.raises(ValueError, match="baseline_rewards"):
        est("remax").advantages(batch)
    batch.metadata["baseline_rewards"] = [1.0, 2.0]
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        est("remax").advantages(batch)


def test_gpg_rescales_by_the_share_of_nonzero_rewards(batch):
    # all 5 rewards non-zero -> alpha = 1: the Dr. GRPO numerators
    adv, _ = est("gpg").advantages(batch)
    torch.testing.assert_close(adv, broadcast([-1.0, 0.75, 1.0, -0.75, 4.0], batch.response_mask))
    # one non-zero reward out of 4 -> alpha = 4; group 0 mean 0.5 -> 4 * (+-0.5); group 1 all zero -> 0
    b = AdvantageBatch(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_index=torch.tensor([0, 0, 1, 1]),
                       response_mask=mask_of([2, 2, 2, 2], t=2))
    adv, _ = est("gpg", f_norm=2.0).advantages(b)
    torch.testing.assert_close(adv, broadcast([1.0, -1.0, 0.0, 0.0], b.response_mask))


def test_grpo_passk_only_the_best_sample_learns(batch):
    # group 7: best is sample 2 (3 vs 1): margin 2 / std sqrt2; group 9: best is sample 1: 1.5 / (0.75 sqrt2)
    # group 4 alone: raw reward 4 / (1 + eps); everybody else 0
    eps = 1e-6
    adv, _ = est("grpo_passk").advantages(batch)
    expected = [0.0, 1.5 / (0.75 * S2 + eps), 2 / (S2 + eps), 0.0, 4 / (1 + eps)]
    torch.testing.assert_close(adv, broadcast(expected, batch.response_mask))
    # three samples 1, 5, 3: margin 2, std 2 -> 1 for the best; a tie at the top gives the group 0
    b = AdvantageBatch(rewards=torch.tensor([1.0, 5.0, 3.0, 1.0, 1.0, 0.0]),
                       group_index=torch.tensor([0, 0, 0, 1, 1, 1]), response_mask=mask_of([1] * 6, t=1))
    adv, _ = est("grpo_passk", epsilon=1e-12).advantages(b)
    torch.testing.assert_close(adv, torch.tensor([[0.0], [1.0], [0.0], [0.0], [0.0], [0.0]]))
    adv, _ = est("grpo_passk", normalize_std=False).advantages(b)
    assert adv[1, 0].item() == 2.0


def _whiten(x, mask):
    # reference: mean and unbiased variance over masked tokens, written out with python floats
    vals = [float(v) for v, m in zip(x.flatten(), mask.flatten()) if m > 0]
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)
    return (x - mu) / math.sqrt(var + 1e-8) * mask


def test_reinforce_plus_plus_gamma_one(batch):
    # gamma 1: the return at every token is the outcome reward -> tokens 1,1,1 | 2 | 3,3 | 4,4,4,4
    # mean 27/10 = 2.7; unbiased var = (3*1.7^2 + 0.7^2 + 2*0.3^2 + 4*1.3^2) / 9 = 16.1 / 9
    adv, ret = est("reinforce_plus_plus").advantages(batch)
    torch.testing.assert_close(ret, broadcast([1.0, 2.0, 3.0, 0.5, 4.0], batch.response_mask))
    expected = (broadcast([1.0, 2.0, 3.0, 0.5, 4.0], batch.response_mask) - 2.7) / math.sqrt(16.1 / 9 + 1e-8)
    torch.testing.assert_close(adv, expected * batch.response_mask)


def test_reinforce_plus_plus_discount_and_token_rewards():
    # one sample, 3 tokens, r = 1 at the last one, token rewards (0.2, 0, -0.4), gamma 0.5:
    # G_2 = 1 - 0.4 = 0.6; G_1 = 0 + 0.5 * 0.6 = 0.3; G_0 = 0.2 + 0.5 * 0.3 = 0.35
    mask = mask_of([3, 2], t=4)
    b = AdvantageBatch(rewards=torch.tensor([1.0, -1.0]), group_index=torch.tensor([0, 1]), response_mask=mask,
                       token_rewards=torch.tensor([[0.2, 0.0, -0.4, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    adv, ret = est("reinforce_plus_plus", gamma=0.5).advantages(b)
    torch.testing.assert_close(ret, torch.tensor([[0.35, 0.3, 0.6, 0.0], [-0.5, -1.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, _whiten(ret, mask))


def test_reinforce_plus_plus_baseline_hand_derived(batch):
    # r - mean_g: -1, 0.75, 1, -0.75, 4 (alone: raw), then whitened over the 10 response tokens
    adv, ret = est("reinforce_plus_plus_baseline").advantages(batch)
    centred = broadcast([-1.0, 0.75, 1.0, -0.75, 4.0], batch.response_mask)
    torch.testing.assert_close(ret, centred)
    torch.testing.assert_close(adv, _whiten(centred, batch.response_mask))


def test_gae_monte_carlo_and_discounted():
    mask = mask_of([3, 1], t=4)
    values = torch.tensor([[0.5, 0.2, 0.1, 7.0], [0.3, 7.0, 7.0, 7.0]])  # 7.0 on padding: ignored
    b = AdvantageBatch(rewards=torch.tensor([1.0, 0.0]), group_index=torch.tensor([0, 1]), response_mask=mask,
                       values=values)
    # gamma = lam = 1: A_t = R - V_t; returns = R on every token
    adv, ret = est("gae", whiten=False).advantages(b)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.9, 0.0], [-0.3, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    # gamma 0.9, lam 0.5: delta = (0.9*0.2 - 0.5, 0.9*0.1 - 0.2, 1 - 0.1) = (-0.32, -0.11, 0.9)
    # A_2 = 0.9; A_1 = -0.11 + 0.45*0.9 = 0.295; A_0 = -0.32 + 0.45*0.295 = -0.18725; returns = A + V
    adv, ret = est("gae", gamma=0.9, lam=0.5, whiten=False).advantages(b)
    torch.testing.assert_close(adv[0], torch.tensor([-0.18725, 0.295, 0.9, 0.0]))
    torch.testing.assert_close(ret[0], torch.tensor([0.31275, 0.495, 1.0, 0.0]))
    adv_w, ret_w = est("gae", gamma=0.9, lam=0.5).advantages(b)
    torch.testing.assert_close(adv_w, _whiten(adv, mask))
    torch.testing.assert_close(ret_w, ret)


def test_gae_needs_values(batch):
    with pytest.raises(ValueError, match="values"):
        est("gae").advantages(batch)


# estimators that learn from rewards; those that learn from a teacher (opd) have their own tests (test_opd.py)
REWARD_ESTIMATORS = sorted(n for n, c in PLUGINS.estimators.items() if not c.needs.teacher)


@pytest.mark.parametrize("name", REWARD_ESTIMATORS)
def test_group_of_one_and_empty_rows_stay_finite(name):
    b = AdvantageBatch(rewards=torch.tensor([2.0, -1.0]), group_index=torch.tensor([0, 1]),
                       response_mask=mask_of([3, 0], t=3), values=torch.zeros(2, 3),
                       metadata={"baseline_rewards": torch.zeros(2)})
    adv, ret = est(name).advantages(b)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[1] == 0).all() and (ret[1] == 0).all()


@pytest.mark.parametrize("name", sorted(PLUGINS.estimators))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_names_the_sample(name, bad, batch):
    batch.values = torch.zeros_like(batch.response_mask)
    batch.metadata["baseline_rewards"] = torch.zeros(5)
    batch.rewards = batch.rewards.clone()
    batch.rewards[2] = bad
    with pytest.raises(ValueError, match=r"reward of sample 2 is"):
        est(name).advantages(batch)


def test_nan_token_reward_on_a_response_token_names_the_sample(batch):
    batch.token_rewards = torch.zeros_like(batch.response_mask)
    batch.token_rewards[4, 1] = float("nan")
    with pytest.raises(ValueError, match=r"token_reward of sample 4"):
        est("grpo").advantages(batch)
    batch.token_rewards[4, 1] = 0.0
    batch.token_rewards[1, 3] = float("nan")  # padding: allowed
    adv, _ = est("grpo").advantages(batch)
    assert torch.isfinite(adv).all()


def test_config_errors_are_reported_by_key():
    from posttrain.core.schema import build

    _, errors = build(PLUGINS.estimators["gae"].Config, {"gamma": 1.5, "lamda": 0.9}, "estimator")
    assert any(e.startswith("estimator.lamda: unknown key") and "lam" in e for e in errors), errors
    assert any(e.startswith("estimator.gamma") for e in errors), errors


# ---- the messages every built-in gives (the contract, tests/contract, asks only for a ValueError) ----------
def _contract_batch(name):
    from posttrain.testing.contracts.estimator import make_batch

    return make_batch(critic=PLUGINS.estimators[name].needs.critic)


@pytest.mark.parametrize("name", sorted(PLUGINS.estimators))
def test_wrong_shapes_name_the_tensors_and_shapes(name):
    batch = _contract_batch(name)
    batch.rewards = batch.rewards[:-1]
    with pytest.raises(ValueError, match=r"rewards \(11,\) and group_index \(12,\) must be \[B\]"):
        est(name).advantages(batch)
    batch = _contract_batch(name)
    batch.token_rewards = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"token_rewards has shape \(3, 3\)"):
        est(name).advantages(batch)


def test_gae_fast_path_equals_the_scan():
    """gamma = lam = 1 uses a reverse cumsum; it must agree with the step-by-step recursion."""
    from posttrain.testing.contracts.estimator import make_batch

    batch = make_batch(b=16, t=9, critic=True, seed=4)
    fast, fast_ret = est("gae", whiten=False).advantages(batch)
    slow, slow_ret = est("gae", gamma=1.0, lam=1.0 - 1e-9, whiten=False).advantages(batch)  # forces the scan
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_ret, slow_ret, atol=1e-5, rtol=1e-5)
