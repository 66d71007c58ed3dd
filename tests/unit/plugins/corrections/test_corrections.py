"""tis, mis and icepop against weights derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.plugins import load_plugins

PLUGINS = load_plugins(autoload=False)  # posttrain's own: a third-party plugin installed changes nothing
LN = math.log


def corr(name, **config):
    cls = PLUGINS.corrections[name]
    return cls(cls.Config(**config))


def test_tis_truncates_token_weights():
    # token ratios 3, 0.5, 1 and one padded token: weights clamp(., 0, 2) = 2, 0.5, 1, 0
    rollout = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    train = rollout + torch.tensor([[LN(3), LN(0.5), 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, m = corr("tis")(train, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0, 0.0]]))
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx((LN(3) + LN(2)) / 3, rel=1e-5)
    assert m["is_weight_mean"] == pytest.approx(3.5 / 3)
    assert m["is_clipped_frac"] == pytest.approx(1 / 3) and m["is_masked_frac"] == 0.0
    w, m = corr("tis", low=0.8, high=1.5)(train, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.8, 1.0, 0.0]]))
    assert m["is_clipped_frac"] == pytest.approx(2 / 3)


def test_icepop_zeroes_tokens_outside_the_bounds():
    rollout = torch.zeros(1, 4) - 1
    train = rollout + torch.tensor([[LN(3), LN(0.4), LN(1.5), 0.0]])
    w, m = corr("icepop", low=0.5, high=2.0)(train, rollout, torch.ones(1, 4))
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.5, 1.0]]))
    assert m["is_masked_frac"] == 0.5 and m["is_clipped_frac"] == 0.0
    assert m["is_weight_mean"] == pytest.approx(2.5 / 4)


def test_mis_masks_whole_sequences():
    # row 0: log-ratios ln2, ln0.5 -> rho = 1 -> weight 1 on both tokens
    # row 1: log-ratios ln3, 0 -> rho = 3 > 2 -> masked; geometric: rho = sqrt(3) = 1.732 -> kept
    # row 2: padding only after one token: log-ratio ln(0.25) -> rho 0.25 < 0.5 -> masked
    rollout = torch.full((3, 2), -2.0)
    train = rollout + torch.tensor([[LN(2), LN(0.5)], [LN(3), 0.0], [LN(0.25), 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    w, m = corr("mis")(train, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
    assert m["is_masked_frac"] == pytest.approx(3 / 5) and m["is_seq_masked_frac"] == pytest.approx(2 / 3)
    w, _ = corr("mis", level="geometric")(train, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [math.sqrt(3), math.sqrt(3)], [0.0, 0.0]]))


def test_bounds_are_validated():
    from posttrain.core.schema import build

    for name in ("tis", "mis", "icepop"):
        _, errors = build(PLUGINS.corrections[name].Config, {"low": 3.0, "high": 2.0}, "correction")
        assert errors == ["correction.low: 3.0 is above high 2.0"], errors


def test_weights_feed_the_loss():
    """The trainer's path: correction(train_old, rollout) -> is_weights -> loss_fn(..., is_weights)."""
    loss_cls = PLUGINS.losses["ppo_clip"]
    loss_fn = loss_cls(loss_cls.Config())
    rollout = torch.full((1, 2), -1.0)
    train_old = rollout + torch.tensor([[LN(3), 0.0]])
    w, _ = corr("icepop")(train_old, rollout, torch.ones(1, 2))  # token 0 dropped (ratio 3 > 2)
    lp = train_old.clone().requires_grad_(True)
    loss, _ = loss_fn(lp, train_old, torch.ones(1, 2), torch.ones(1, 2), is_weights=w)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5]]))


def test_mis_levels_modes_and_veto():
    # one sequence, token ratios 3, 0.5, 1 (sequence ratio 1.5, geometric 1.5^(1/3))
    rollout = torch.full((1, 3), -1.0)
    train = rollout + torch.tensor([[LN(3), LN(0.5), 0.0]])
    mask = torch.ones(1, 3)
    w, m = corr("mis", level="token")(train, rollout, mask)  # mask mode: 3 is out of [0.5, 2]
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.0]]))
    assert m["is_masked_frac"] == pytest.approx(1 / 3) and m["is_seq_masked_frac"] == 0.0
    w, m = corr("mis", level="token", mode="truncate", high=2.0)(train, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0]]))
    assert m["is_clipped_frac"] == pytest.approx(1 / 3) and m["is_masked_frac"] == 0.0
    w, _ = corr("mis", level="token", mode="clip", low=0.8, high=2.0)(train, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.8, 1.0]]))
    w, _ = corr("mis", level="sequence", mode="clip", low=0.8, high=1.2)(train, rollout, mask)
    torch.testing.assert_close(w, torch.full((1, 3), 1.2))
    w, _ = corr("mis", level="geometric")(train, rollout, mask)
    torch.testing.assert_close(w, torch.full((1, 3), 1.5 ** (1 / 3)))
    # veto: a token ratio of 0.5 below 0.6 drops the whole sequence, whatever the mode
    w, m = corr("mis", veto_threshold=0.6)(train, rollout, mask)
    assert (w == 0).all() and m["is_veto_seq_frac"] == 1.0 and m["is_masked_frac"] == 1.0
