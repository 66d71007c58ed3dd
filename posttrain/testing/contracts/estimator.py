"""The estimator contract: shapes, masks, purity, input checks and group invariances."""

from __future__ import annotations

import pytest

from posttrain.testing.contracts.common import ComponentContract


def make_batch(b: int = 12, g: int = 4, t: int = 7, seed: int = 0, critic: bool = False):
    """A synthetic ``AdvantageBatch``: ``b // g`` groups with non-contiguous ids and right padding.

    ``metadata["baseline_rewards"]`` (``[B]``) is filled for estimators with a per-sample baseline (ReMax),
    ``log_probs`` and ``metadata["teacher_log_probs"]`` (``[B, T]``, negative) for those that compare the
    policy with a teacher (on-policy distillation).
    """
    import torch

    from posttrain.core.types import AdvantageBatch

    gen = torch.Generator().manual_seed(seed)
    group_index = torch.arange(b) % (b // g) * 7 + 3  # interleaved, not positional
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    values = torch.randn(b, t, generator=gen) * mask if critic else None
    log_probs = -torch.rand(b, t, generator=gen) * 3 * mask
    teacher = -torch.rand(b, t, generator=gen) * 3 * mask
    return AdvantageBatch(rewards=torch.randn(b, generator=gen), group_index=group_index, response_mask=mask,
                          values=values, log_probs=log_probs,
                          metadata={"baseline_rewards": torch.randn(b, generator=gen), "teacher_log_probs": teacher})


def _permuted(batch, perm):
    """``batch`` with every per-sample tensor (metadata included) reordered by ``perm``."""
    def take(v):
        return v[perm] if hasattr(v, "shape") else v

    fields = {k: take(v) for k, v in vars(batch).items() if k != "metadata"}
    return type(batch)(**fields, metadata={k: take(v) for k, v in batch.metadata.items()})


class EstimatorContract(ComponentContract):
    """Supply an ``estimator`` fixture."""

    @pytest.fixture
    def component(self, estimator):
        return estimator

    def _batch(self, estimator, **kw):
        return make_batch(critic=getattr(estimator, "needs_critic", False), **kw)

    def test_shapes_finite_and_zero_outside_mask(self, estimator):
        import torch

        batch = self._batch(estimator)
        adv, ret = estimator.advantages(batch)
        for out in (adv, ret):
            assert out.shape == batch.response_mask.shape
            assert torch.isfinite(out).all()
            assert (out[batch.response_mask == 0] == 0).all(), "values outside the response mask must be 0"

    def test_inputs_not_mutated(self, estimator):
        import torch

        batch = self._batch(estimator)
        batch.token_rewards = 0.1 * torch.ones_like(batch.response_mask)
        tensors = {**{k: v for k, v in vars(batch).items() if hasattr(v, "clone")}, **batch.metadata}
        before = {k: v.clone() for k, v in tensors.items()}
        estimator.advantages(batch)
        for k, v in before.items():
            assert (tensors[k] == v).all(), f"advantages() mutated batch.{k}"

    def test_equivariant_to_permuting_samples(self, estimator):
        """Permuting samples (within and across groups) permutes the advantages the same way."""
        import torch

        batch = self._batch(estimator)
        adv, _ = estimator.advantages(batch)
        perm = torch.randperm(len(batch.rewards), generator=torch.Generator().manual_seed(1))
        adv_p, _ = estimator.advantages(_permuted(batch, perm))
        torch.testing.assert_close(adv_p, adv[perm], atol=1e-5, rtol=1e-5)

    def test_group_baseline_invariant_to_group_shift(self, estimator):
        """``group_baseline = True`` promises: a constant added to one group's rewards changes nothing."""
        import torch

        declared = getattr(estimator, "group_baseline", False)
        assert isinstance(declared, bool), "group_baseline must be a bool class attribute"
        if not declared:
            pytest.skip("not a group-baseline estimator (group_baseline = False)")
        batch = self._batch(estimator)
        adv, _ = estimator.advantages(batch)
        shifted = type(batch)(**vars(batch))
        one_group = batch.group_index == batch.group_index[0]
        shifted.rewards = batch.rewards + 5.0 * one_group
        adv_s, _ = estimator.advantages(shifted)
        torch.testing.assert_close(adv_s, adv, atol=1e-4, rtol=1e-4)

    def test_padding_garbage_does_not_leak(self, estimator):
        """NaN in ``values``/``token_rewards``/log-probs outside the mask (padding) must not reach the output."""
        import torch

        batch = self._batch(estimator)
        outside = batch.response_mask == 0
        assert outside.any()
        batch.token_rewards = torch.where(outside, float("nan"), 0.1)
        batch.log_probs = torch.where(outside, float("nan"), batch.log_probs)
        batch.metadata["teacher_log_probs"] = torch.where(outside, float("nan"), batch.metadata["teacher_log_probs"])
        if batch.values is not None:
            batch.values = torch.where(outside, float("nan"), batch.values)
        adv, ret = estimator.advantages(batch)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
