"""core.losses helpers and the policy losses against values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.losses import (AGGREGATION_MODES, aggregate, batch_counts, entropy_from_logits, kl_divergence,
                                   kl_penalty_rewards, value_loss)
from posttrain.core.plugins import load_plugins

PLUGINS = load_plugins(autoload=False)  # posttrain's own: a third-party plugin installed changes nothing
LN = math.log


def loss_of(name, **config):
    cls = PLUGINS.losses[name]
    return cls(cls.Config(**config))


# ---- aggregation -------------------------------------------------------------------------------------------
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [5.0, 5.0, 5.0]])  # 99: padding
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2: no tokens


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 10 / 4),                      # (1+2+3+4) / 4 tokens
    ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),  # mean of per-sequence means over 2 sequences
    ("seq-mean-token-sum", (6 + 4) / 2),
    ("seq-mean-token-sum-norm", (6 / 3 + 4 / 3) / 2),  # constant normalizer T = 3
])
def test_aggregate_modes(mode, expected):
    assert aggregate(VALUES, MASK, mode).item() == pytest.approx(expected)


def test_aggregate_global_counts_and_max_len():
    assert aggregate(VALUES, MASK, "token-mean", global_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate(VALUES, MASK, "seq-mean-token-mean", global_seqs=4).item() == pytest.approx(6 / 4)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", max_response_len=10).item() == pytest.approx(
        (6 / 10 + 4 / 10) / 2)
    assert batch_counts(MASK) == (4, 2)


def test_aggregate_empty_mask_is_zero_and_bad_mode_is_named():
    for mode in AGGREGATION_MODES:
        assert aggregate(VALUES, torch.zeros_like(MASK), mode).item() == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(VALUES, MASK, "token_mean")


def test_aggregation_is_a_config_choice_with_a_clear_error():
    from posttrain.core.schema import build

    _, errors = build(PLUGINS.losses["ppo_clip"].Config, {"aggregation": "seq-mean"}, "loss")
    assert errors and errors[0].startswith("loss.aggregation:") and "seq-mean-token-mean" in errors[0]


# ---- KL, entropy, value loss ---------------------------------------------------------------------------------
def test_kl_estimators_hand_derived():
    lp, ref = torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.5, -0.5]])  # d = +0.5, -0.5
    torch.testing.assert_close(kl_divergence(lp, ref, "k1"), torch.tensor([[0.5, -0.5]]))
    torch.testing.assert_close(kl_divergence(lp, ref, "k2"), torch.tensor([[0.125, 0.125]]))
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(0.5) - 1 - 0.5]
    torch.testing.assert_close(kl_divergence(lp, ref, "k3"), torch.tensor([k3]))
    with pytest.raises(ValueError, match="k3"):
        kl_divergence(lp, ref, "k4")


def test_kl_k3_is_clamped_and_has_finite_gradient():
    lp = torch.tensor([[-100.0, 0.0]], requires_grad=True)
    kl = kl_divergence(lp, torch.tensor([[0.0, 0.0]]), "k3")
    assert kl[0, 0].item() == 10.0 and kl[0, 1].item() == 0.0
    kl.sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_kl_loss_gradient_matches_the_formula():
    # d/dlp of mean k3 = (1 - exp(-d)) / N
    lp = torch.tensor([[-1.0, -2.0, -0.3]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    aggregate(kl_divergence(lp, ref, "k3"), mask, "token-mean").backward()
    d = torch.tensor([0.5, -1.0])
    torch.testing.assert_close(lp.grad[0, :2], (1 - torch.exp(-d)) / 2)
    assert lp.grad[0, 2] == 0


def test_kl_penalty_rewards():
    lp, ref = torch.tensor([[0.0, -1.0, -1.0]]), torch.tensor([[-0.5, -0.5, 3.0]])
    out = kl_penalty_rewards(lp, ref, torch.tensor([[1.0, 1.0, 0.0]]), coef=0.1, kind="k1")
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.05, 0.0]]))
    assert not out.requires_grad


def test_entropy_from_logits():
    logits = torch.zeros(1, 2, 4)
    logits[0, 1] = torch.tensor([0.0, 0.0, -1e9, -1e9])  # two equally likely tokens
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[LN(4), LN(2)]]))


def test_value_loss_clipping():
    # token 0: V 1.0, V_old 0.5, R 2: V_clip = 0.7 -> max((1-2)^2, (0.7-2)^2) = 1.69 (clipped)
    # token 1: V 0.6, V_old 0.5, R 0: inside the clip -> 0.36
    values = torch.tensor([[1.0, 0.6, 5.0]], requires_grad=True)
    old, ret, mask = torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([[1.0, 1, 0]])
    loss, metrics = value_loss(values, old, ret, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.36) / 2)
    assert metrics["vf_clipfrac"] == 0.5
    loss.backward()
    # clipped token: no gradient (V_clip is constant in V there); other: 0.5 * 2 (V - R) / 2
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.3, 0.0]]))
    plain, _ = value_loss(values, old, ret, mask, clip=None)
    assert plain.item() == pytest.approx(0.5 * (1.0 + 0.36) / 2)


# ---- policy losses ------------------------------------------------------------------------------------------
def _inputs(ratios, advantages):
    old = torch.full((1, len(ratios)), -1.0)
    lp = (old + torch.tensor([[LN(r) for r in ratios]])).requires_grad_(True)
    return lp, old, torch.tensor([advantages]), torch.ones(1, len(ratios))


def test_ppo_clip_hand_derived():
    # ratio, A -> per-token loss (clip 0.8..1.28):
    # 1.5, +1 -> max(-1.5, -1.28) = -1.28 clipped | 0.5, +1 -> max(-0.5, -0.8) = -0.5
    # 1.1, -1 -> 1.1                              | 0.5, -1 -> max(0.5, 0.8) = 0.8 clipped
    lp, old, adv, mask = _inputs([1.5, 0.5, 1.1, 0.5], [1.0, 1.0, -1.0, -1.0])
    loss, metrics = loss_of("ppo_clip", clip_low=0.2, clip_high=0.28)(lp, old, adv, mask)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.1 + 0.8) / 4)
    assert metrics["clipfrac"] == 0.5
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5) / 4)
    expected_kl = sum(r - 1 - LN(r) for r in (1.5, 0.5, 1.1, 0.5)) / 4
    assert metrics["approx_kl"] == pytest.approx(expected_kl, rel=1e-5)
    loss.backward()
    # d/dlp of -A ratio = -A ratio where unclipped; 0 where clipped; divided by 4 tokens
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5 / 4, 1.1 / 4, 0.0]]))


def test_ppo_dual_clip():
    # ratio 4, A = -1: max(4, 1.28) = 4; dual clip c = 3 caps it at -c A = 3 (and cuts the gradient)
    lp, old, adv, mask = _inputs([4.0, 1.0], [-1.0, 1.0])
    loss, metrics = loss_of("ppo_clip", dual_clip=3.0)(lp, old, adv, mask)
    assert loss.item() == pytest.approx((3.0 - 1.0) / 2)
    assert metrics["dual_clipfrac"] == 0.5
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5]]))
    no_dual, _ = loss_of("ppo_clip")(lp, old, adv, mask)
    assert no_dual.item() == pytest.approx((4.0 - 1.0) / 2)


def test_ppo_log_ratio_is_clamped():
    lp, old = torch.tensor([[0.0]], requires_grad=True), torch.tensor([[-1000.0]])
    loss, metrics = loss_of("ppo_clip")(lp, old, torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert math.isfinite(loss.item()) and metrics["ratio_mean"] == pytest.approx(math.exp(20), rel=1e-5)


def test_gspo_sequence_ratio_and_straight_through_gradient():
    # seq 0: log-ratios 0.1, -0.3 -> s = exp(-0.1), inside the clip -> loss -s per token, grad -s / 2 per token
    # seq 1: log-ratios 0.5, 0.5 -> s = exp(0.5) > 1.2 -> clipped: loss -1.2, no gradient
    old = torch.full((2, 3), -1.0)
    lp = (old + torch.tensor([[0.1, -0.3, 0.0], [0.5, 0.5, 0.0]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.ones(2, 3) * mask
    loss, metrics = loss_of("gspo", clip_low=0.2, clip_high=0.2)(lp, old, adv, mask)
    s = math.exp(-0.1)
    assert loss.item() == pytest.approx((-s - 1.2) / 2, rel=1e-6)
    assert metrics["clipfrac"] == 0.5
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-s / 4, -s / 4, 0.0], [0.0, 0.0, 0.0]]))


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # ratio 1.5 -> weight clipped to 1.28; A 2, logp -0.5 -> loss -1.28 * 2 * -0.5 = 1.28, grad -1.28 * 2
    # ratio 0.5 -> weight 0.5 (no lower bound by default); A -1, logp -1.7 -> loss -0.5 * -1 * -1.7 = -0.85
    old = torch.tensor([[-0.5 - LN(1.5), -1.7 - LN(0.5)]])
    lp = torch.tensor([[-0.5, -1.7]], requires_grad=True)
    loss, metrics = loss_of("cispo")(lp, old, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx((1.28 - 0.85) / 2, rel=1e-5)
    assert metrics["clipfrac"] == 0.5
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28 * 2 / 2, 0.5 / 2]]))


def test_is_weights_multiply_per_token_losses():
    lp, old, adv, mask = _inputs([1.0, 1.0], [1.0, -2.0])  # on-policy: per-token losses -1, +2
    loss, _ = loss_of("ppo_clip")(lp, old, adv, mask, is_weights=torch.tensor([[0.5, 2.0]]))
    assert loss.item() == pytest.approx((-0.5 + 4.0) / 2)


def test_trainer_combination_documented_in_core_losses():
    """total = pg_loss + kl_loss_coef * kl - entropy_coef * entropy, all with the same aggregation."""
    import posttrain.core.losses as core_losses

    assert "total = pg_loss + kl_loss_coef * kl - entropy_coef * ent" in core_losses.__doc__
    lp, old, adv, mask = _inputs([1.2, 0.9], [1.0, -1.0])
    ref = old - 0.1
    pg, _ = loss_of("ppo_clip")(lp, old, adv, mask)
    kl = aggregate(kl_divergence(lp, ref, "k3"), mask, "token-mean")
    total = pg + 0.1 * kl
    total.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_kl_entropy_and_value_terms_are_micro_batch_invariant(mode):
    """The trainer's extra terms (KL loss, entropy bonus, value loss) sum over micro-batches exactly too."""
    gen = torch.Generator().manual_seed(0)
    b, t = 6, 5
    mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (b,), generator=gen)[:, None]).float()
    mask[2] = 0.0
    ref, old_v, ret = (torch.randn(b, t, generator=gen) for _ in range(3))
    base = torch.randn(b, t, generator=gen)
    tokens, seqs = batch_counts(mask)

    def terms(x, rows, counts):
        kl = aggregate(kl_divergence(x[rows], ref[rows], "k3"), mask[rows], mode, *counts, max_response_len=8)
        ent = aggregate(x[rows] ** 2, mask[rows], mode, *counts, max_response_len=8)
        vf, _ = value_loss(x[rows], old_v[rows], ret[rows], mask[rows], 0.2, mode, *counts, max_response_len=8)
        return kl + 0.3 * ent + 0.5 * vf

    full_x = base.clone().requires_grad_(True)
    full = terms(full_x, slice(0, b), (None, None))
    full.backward()
    x = base.clone().requires_grad_(True)
    total = terms(x, slice(0, 4), (tokens, seqs)) + terms(x, slice(4, 6), (tokens, seqs))
    total.backward()
    torch.testing.assert_close(total, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad, full_x.grad, atol=1e-6, rtol=1e-6)


def test_total_loss_combines_terms_and_refuses_missing_inputs():
    from posttrain.core.losses import total_loss

    lp, old, adv, mask = _inputs([1.2, 0.9], [1.0, -1.0])
    ref, entropy = old - 0.1, torch.tensor([[0.7, 0.3]])
    pg, _ = loss_of("ppo_clip")(lp, old, adv, mask)
    total, metrics = total_loss(pg, mask, log_probs=lp, ref_log_probs=ref, entropy=entropy, kl_loss_coef=0.1,
                                entropy_coef=0.01)
    kl = aggregate(kl_divergence(lp, ref, "k3"), mask, "token-mean")
    assert total.item() == pytest.approx((pg + 0.1 * kl - 0.01 * 0.5).item())
    assert metrics["kl_loss"] == pytest.approx(kl.item()) and metrics["entropy"] == pytest.approx(0.5)
    total.backward()
    assert torch.isfinite(lp.grad).all()
    with pytest.raises(ValueError, match="ref_log_probs"):
        total_loss(pg, mask, log_probs=lp, kl_loss_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        total_loss(pg, mask, entropy_coef=0.01)
    same, metrics = total_loss(pg, mask, log_probs=lp, ref_log_probs=ref)  # coefficient 0: measured only
    assert same is pg and "kl_loss" in metrics


def test_ppo_opsm_masks_far_negative_sequences():
    # seq 0: log(old/new) = 0.2, 0.4 -> kl 0.3 > 0.1, A < 0 -> masked (loss 0, no gradient)
    # seq 1: same drift but A > 0 -> kept; seq 2: A < 0, kl 0.05 -> kept
    old = torch.full((3, 2), -1.0)
    lp = (old - torch.tensor([[0.2, 0.4], [0.2, 0.4], [0.05, 0.05]])).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    loss, metrics = loss_of("ppo_clip", opsm_delta=0.1)(lp, old, adv, torch.ones(3, 2))
    r = torch.exp(-torch.tensor([0.2, 0.4, 0.05]))
    kept = -r[0] - r[1] + 2 * r[2]  # seq 1 (A > 0): -ratio per token; seq 2 (A < 0): +ratio per token
    assert loss.item() == pytest.approx(kept.item() / 6, rel=1e-5)
    assert metrics["opsm_frac"] == pytest.approx(2 / 6)
    loss.backward()
    assert (lp.grad[0] == 0).all() and (lp.grad[2] != 0).all()


def test_unbiased_kl_is_importance_weighted():
    # k1 with ratio: d * exp(lp - old); d = 0.5, lp - old = ln 2 -> 1.0; gradient d/dlp (d e^(lp-old)) = e(1 + d) = 3
    lp = torch.tensor([[-1.0]], requires_grad=True)
    ref, old = torch.tensor([[-1.5]]), torch.tensor([[-1.0 - LN(2)]])
    kl = kl_divergence(lp, ref, "k1", old_log_probs=old)
    assert kl.item() == pytest.approx(1.0)
    kl.sum().backward()
    assert lp.grad.item() == pytest.approx(3.0)
    # on-policy (old == lp), the value equals the plain estimate
    torch.testing.assert_close(kl_divergence(lp, ref, "k3", old_log_probs=lp.detach()), kl_divergence(lp, ref, "k3"))


@pytest.mark.parametrize("name", sorted(PLUGINS.losses))
def test_builtin_losses_name_the_tensor_and_both_shapes(name):
    """Stricter than the contract's ``ValueError``: the message every built-in gives (PolicyLoss's)."""
    from posttrain.testing.contracts.loss import make_inputs

    lp, old, adv, mask = make_inputs()
    with pytest.raises(ValueError, match=r"old_log_probs has shape \(6, 8\), log_probs \(6, 9\); all must be \[B, T\]"):
        loss_of(name)(lp, old[:, :-1], adv, mask)


def test_gmpo_geometric_mean_of_sign_aware_clipped_log_ratios():
    # seq 0, A = +1, d = (0.1, 0.6): clipped pessimistically to (0.1, 0.4) -> r = e^0.25, L = -e^0.25
    # seq 1, A = -1, d = (-0.6, 0.2): clipped to (-0.4, 0.2) -> r = e^-0.1, L = +e^-0.1
    # seq-mean-token-mean over 2 sequences; gradient flows only through unclipped tokens: -A r / (n S)
    old = torch.full((2, 2), -1.0)
    lp = (old + torch.tensor([[0.1, 0.6], [-0.6, 0.2]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, metrics = loss_of("gmpo")(lp, old, adv, torch.ones(2, 2))
    assert loss.item() == pytest.approx((-math.exp(0.25) + math.exp(-0.1)) / 2, rel=1e-6)
    assert metrics["clipfrac"] == 0.5
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-math.exp(0.25) / 4, 0.0], [0.0, math.exp(-0.1) / 4]]))


def test_reinforce_is_minus_advantage_times_logp():
    lp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    loss, metrics = loss_of("reinforce")(lp, lp.detach() - 0.1, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx((1.0 - 2.0) / 2)
    assert metrics["clipfrac"] == 0.0 and metrics["ratio_mean"] == pytest.approx(math.exp(0.1))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.5]]))


def test_kl_abs_and_straight_through_kinds():
    lp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-0.5, -0.5]])  # d = +0.5, -0.5
    torch.testing.assert_close(kl_divergence(lp, ref, "abs"), torch.tensor([[0.5, 0.5]]))
    for kind in ("k1+", "k3+"):
        lp.grad = None
        kl = kl_divergence(lp, ref, kind)
        torch.testing.assert_close(kl, kl_divergence(lp, ref, kind[:-1]))  # the value of k1 / k3
        kl.sum().backward()
        torch.testing.assert_close(lp.grad, torch.tensor([[0.5, -0.5]]))  # the gradient of k2: d


def test_nan_padding_never_reaches_the_extra_terms():
    from posttrain.core.losses import total_loss

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    lp = torch.tensor([[-1.0, -0.5, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-1.2, -0.4, float("nan")]])
    entropy = torch.tensor([[0.5, 0.7, float("nan")]])
    total, metrics = total_loss(torch.zeros(()), mask, log_probs=lp, ref_log_probs=ref, entropy=entropy,
                                kl_loss_coef=0.1, entropy_coef=0.01, old_log_probs=ref)
    values = torch.tensor([[0.3, 0.1, float("nan")]], requires_grad=True)
    vf, _ = value_loss(values, torch.tensor([[0.2, 0.0, float("nan")]]), torch.tensor([[1.0, 1.0, float("nan")]]),
                       mask)
    (total + vf).backward()
    assert torch.isfinite(total) and torch.isfinite(vf)
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 2] == 0 and values.grad[0, 2] == 0
