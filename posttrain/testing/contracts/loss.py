"""The policy-loss contract: a scalar with gradient, finite, no gradient through masked tokens."""

from __future__ import annotations

import pytest

from posttrain.testing.contracts.common import ComponentContract


def make_inputs(b: int = 6, t: int = 9, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=gen) * 3
    log_probs = (old + 0.3 * torch.randn(b, t, generator=gen)).clamp(max=0).requires_grad_(True)
    advantages = torch.randn(b, 1, generator=gen).expand(b, t) * mask
    return log_probs, old, advantages, mask


class LossContract(ComponentContract):
    """Supply a ``loss`` fixture."""

    @pytest.fixture
    def component(self, loss):
        return loss

    def test_scalar_with_gradient_and_float_metrics(self, loss):
        import torch

        log_probs, old, adv, mask = make_inputs()
        value, metrics = loss(log_probs, old, adv, mask)
        assert value.dim() == 0 and torch.isfinite(value)
        value.backward()
        assert log_probs.grad is not None and torch.isfinite(log_probs.grad).all()
        assert all(isinstance(v, float) for v in metrics.values()), metrics

    def test_no_gradient_through_masked_tokens(self, loss):
        log_probs, old, adv, mask = make_inputs(seed=3)
        value, _ = loss(log_probs, old, adv, mask)
        value.backward()
        assert (log_probs.grad[mask == 0] == 0).all()

    def test_inputs_not_mutated(self, loss):
        log_probs, old, adv, mask = make_inputs(seed=4)
        copies = [x.detach().clone() for x in (log_probs, old, adv, mask)]
        loss(log_probs, old, adv, mask)
        for x, c in zip((log_probs, old, adv, mask), copies):
            assert (x.detach() == c).all()
