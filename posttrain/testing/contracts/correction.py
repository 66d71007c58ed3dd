"""The correction contract (rollout/training mismatch): weights in shape, zero outside the mask,
non-negative, without gradient, 1 where the engines agree, and the mismatch metrics."""

from __future__ import annotations

import pytest

from posttrain.testing.contracts.common import ComponentContract

REQUIRED_METRICS = {"train_rollout_logprob_abs_diff", "is_weight_mean", "is_masked_frac", "is_clipped_frac"}


def make_log_probs(b: int = 5, t: int = 8, seed: int = 0, noise: float = 0.3):
    """``(train_log_probs (requires grad), rollout_log_probs, mask)``, all ``[b, t]``, right-padded."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    rollout = -torch.rand(b, t, generator=gen) * 2
    train = (rollout + noise * torch.randn(b, t, generator=gen)).requires_grad_(True)
    return train, rollout, mask


class CorrectionContract(ComponentContract):
    """Supply a ``correction`` fixture."""

    @pytest.fixture
    def component(self, correction):
        return correction

    def test_weights_shape_mask_sign_and_no_grad(self, correction):
        import torch

        train, rollout, mask = make_log_probs()
        weights, metrics = correction(train, rollout, mask)
        assert weights.shape == mask.shape
        assert not weights.requires_grad, "importance weights must carry no gradient"
        assert torch.isfinite(weights).all() and (weights >= 0).all()
        assert (weights[mask == 0] == 0).all()
        assert REQUIRED_METRICS <= set(metrics), sorted(metrics)
        assert all(isinstance(v, float) for v in metrics.values()), metrics

    def test_agreeing_engines_give_weight_one(self, correction):
        import torch

        train, _, mask = make_log_probs(seed=1)
        weights, metrics = correction(train, train.detach().clone(), mask)
        torch.testing.assert_close(weights, mask)
        assert metrics["train_rollout_logprob_abs_diff"] == 0.0
        assert metrics["is_masked_frac"] == 0.0 and metrics["is_clipped_frac"] == 0.0

    def test_padding_garbage_does_not_leak(self, correction):
        import torch

        train, rollout, mask = make_log_probs(seed=3)
        assert (mask == 0).any()
        with torch.no_grad():
            train[mask == 0] = float("nan")
        rollout = torch.where(mask > 0, rollout, float("-inf"))
        weights, metrics = correction(train, rollout, mask)
        assert torch.isfinite(weights).all() and (weights[mask == 0] == 0).all()
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics

    def test_reports_the_mismatch(self, correction):
        import torch

        train, rollout, mask = make_log_probs(seed=2)
        _, metrics = correction(train, rollout, mask)
        expected = ((train.detach() - rollout).abs() * mask).sum() / mask.sum()
        assert abs(metrics["train_rollout_logprob_abs_diff"] - float(expected)) < 1e-5
        assert torch.isfinite(torch.tensor(list(metrics.values()))).all()
