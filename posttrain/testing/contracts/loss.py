"""The policy-loss contract: a scalar with gradient, finite, no gradient through masked tokens,
importance weights applied, and micro-batch invariance for every aggregation mode.

The rules, for every loss (``loss(log_probs, old_log_probs, advantages, response_mask, is_weights=None,
global_tokens=None, global_seqs=None) -> (loss, metrics)``, tensors ``[B, T]``):

- a finite scalar with a finite gradient; ``float`` metrics with at least ``clipfrac``, ``approx_kl`` and
  ``ratio_mean`` (1, 0 and 0 on-policy);
- no gradient through masked tokens, whatever padding holds (NaN included); inputs not mutated;
- ``is_weights`` of 1 change nothing, a weight of 0 removes that token's gradient;
- micro-batch invariance: micro-batch losses with the whole batch's counts sum to the full-batch loss
  and gradient, in every aggregation mode the ``Config`` accepts;
- bf16 inputs are reduced in float32 (a float32 loss, a finite bf16 gradient, the float32 result);
- inputs of different shapes raise ``ValueError`` naming them.

Subclassing ``posttrain.core.losses.PolicyLoss`` gives the shape checks, weights, aggregation modes and
metrics.
"""

from __future__ import annotations

import dataclasses

import pytest

from posttrain.testing.contracts.common import ComponentContract


def make_inputs(b: int = 6, t: int = 9, seed: int = 0):
    """``(log_probs (leaf, requires grad), old_log_probs, advantages, mask)``, all ``[b, t]``, right-padded."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=gen) * 3
    log_probs = (old + 0.3 * torch.randn(b, t, generator=gen)).clamp(max=0).requires_grad_(True)
    advantages = torch.randn(b, 1, generator=gen).expand(b, t) * mask
    return log_probs, old, advantages, mask


def with_aggregations(loss):
    """The loss rebuilt with every aggregation mode its ``Config`` accepts (just itself if it has none)."""
    from posttrain.core.losses import AGGREGATION_MODES

    if not any(f.name == "aggregation" for f in dataclasses.fields(loss.config)):
        return [loss]
    return [type(loss)(dataclasses.replace(loss.config, aggregation=m)) for m in AGGREGATION_MODES]


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

    def test_on_policy_metrics_are_neutral(self, loss):
        """On-policy (``old == log_probs``): ``ratio_mean`` 1, ``approx_kl`` 0, ``clipfrac`` 0 where reported."""
        import math

        log_probs, _, adv, mask = make_inputs(seed=5)
        _, metrics = loss(log_probs, log_probs.detach().clone(), adv, mask)
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        expected = {"ratio_mean": 1.0, "approx_kl": 0.0, "clipfrac": 0.0}
        for key, value in expected.items():
            if key in metrics:
                assert metrics[key] == pytest.approx(value, abs=1e-6), (key, metrics[key])

    def test_no_gradient_through_masked_tokens(self, loss):
        import math

        import torch

        for fn in with_aggregations(loss):
            log_probs, old, adv, mask = make_inputs(seed=3)
            with torch.no_grad():  # garbage on padding must not leak into the loss, metrics or gradient
                old[mask == 0] = float("nan")
            value, metrics = fn(log_probs, old, adv, mask)
            value.backward()
            assert torch.isfinite(value) and all(math.isfinite(v) for v in metrics.values()), metrics
            assert (log_probs.grad[mask == 0] == 0).all()

    def test_inputs_not_mutated(self, loss):
        log_probs, old, adv, mask = make_inputs(seed=4)
        copies = [x.detach().clone() for x in (log_probs, old, adv, mask)]
        loss(log_probs, old, adv, mask)
        for x, c in zip((log_probs, old, adv, mask), copies):
            assert (x.detach() == c).all()

    def test_is_weights_scale_the_tokens(self, loss):
        """Weights of 1 change nothing; a weight of 0 removes that token's gradient."""
        import torch

        log_probs, old, adv, mask = make_inputs(seed=6)
        plain, _ = loss(log_probs, old, adv, mask)
        ones, _ = loss(log_probs, old, adv, mask, is_weights=torch.ones_like(mask))
        torch.testing.assert_close(ones, plain)
        weights = torch.ones_like(mask)
        weights[:, ::2] = 0.0
        # on-policy (ratio 1), so no clipping can hide the gradient of the weighted tokens
        value, _ = loss(log_probs, log_probs.detach().clone(), adv, mask, is_weights=weights)
        value.backward()
        assert (log_probs.grad[:, ::2] == 0).all()
        assert log_probs.grad[:, 1::2][mask[:, 1::2] > 0].abs().sum() > 0

    def test_micro_batch_invariance(self, loss):
        """Summing micro-batch losses normalized by the whole batch's counts reproduces the full-batch
        loss and gradient (to 1e-6), for every aggregation mode, whatever the split."""
        import torch

        from posttrain.core.losses import batch_counts

        for fn in with_aggregations(loss):
            log_probs, old, adv, mask = make_inputs(b=7, seed=7)
            mask = mask.clone()
            mask[4] = 0.0  # a sequence with no training tokens must not change the counts' meaning
            weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(8)) + 0.5
            tokens, seqs = batch_counts(mask)
            full_lp = log_probs.detach().clone().requires_grad_(True)
            full, _ = fn(full_lp, old, adv, mask, is_weights=weights)
            full.backward()
            for splits in ([2, 5], [1, 3, 3], [7]):
                lp = log_probs.detach().clone().requires_grad_(True)
                total, start = 0.0, 0
                for size in splits:
                    rows = slice(start, start + size)
                    part, _ = fn(lp[rows], old[rows], adv[rows], mask[rows], is_weights=weights[rows],
                                 global_tokens=tokens, global_seqs=seqs)
                    total = total + part
                    start += size
                total.backward()
                what = f"{fn.config.aggregation if hasattr(fn.config, 'aggregation') else ''} split {splits}"
                torch.testing.assert_close(total, full, atol=1e-6, rtol=1e-6, msg=f"loss differs: {what}")
                torch.testing.assert_close(lp.grad, full_lp.grad, atol=1e-6, rtol=1e-6,
                                           msg=f"gradient differs: {what}")

    def test_reports_the_standard_metrics(self, loss):
        log_probs, old, adv, mask = make_inputs()
        _, metrics = loss(log_probs, old, adv, mask)
        missing = {"clipfrac", "approx_kl", "ratio_mean"} - set(metrics)
        assert not missing, f"a loss reports clipfrac, approx_kl and ratio_mean; missing {sorted(missing)}"

    def test_wrong_shapes_raise_a_clear_error(self, loss):
        log_probs, old, adv, mask = make_inputs()
        with pytest.raises(ValueError, match="old_log_probs"):
            loss(log_probs, old[:, :-1], adv, mask)

    def test_bf16_inputs_are_reduced_in_fp32(self, loss):
        import torch

        log_probs, old, adv, mask = make_inputs(seed=9)
        reference, _ = loss(log_probs, old, adv, mask)
        lp16 = log_probs.detach().bfloat16().requires_grad_(True)
        value, _ = loss(lp16, old.bfloat16(), adv.bfloat16(), mask.bfloat16())
        assert value.dtype == torch.float32, f"bf16 inputs: the loss is {value.dtype}, expected float32"
        value.backward()
        assert lp16.grad.dtype == torch.bfloat16 and torch.isfinite(lp16.grad.float()).all()
        assert value.item() == pytest.approx(reference.item(), abs=0.05)
