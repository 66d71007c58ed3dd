"""The estimator contract: shapes, masks, purity, and group invariances."""

from __future__ import annotations

import pytest

from posttrain.testing.contracts.common import ComponentContract


def make_batch(b: int = 12, g: int = 4, t: int = 7, seed: int = 0, critic: bool = False):
    """A synthetic ``AdvantageBatch``: ``b // g`` groups with non-contiguous ids and right padding."""
    import torch

    from posttrain.core.types import AdvantageBatch

    gen = torch.Generator().manual_seed(seed)
    group_index = torch.arange(b) % (b // g) * 7 + 3  # interleaved, not positional
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    values = torch.randn(b, t, generator=gen) * mask if critic else None
    return AdvantageBatch(rewards=torch.randn(b, generator=gen), group_index=group_index, response_mask=mask,
                          values=values)


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
        batch = self._batch(estimator)
        before = {k: v.clone() for k, v in vars(batch).items() if hasattr(v, "clone")}
        estimator.advantages(batch)
        for k, v in before.items():
            assert (getattr(batch, k) == v).all(), f"advantages() mutated batch.{k}"

    def test_equivariant_to_permuting_samples(self, estimator):
        import torch

        batch = self._batch(estimator)
        adv, _ = estimator.advantages(batch)
        perm = torch.randperm(len(batch.rewards), generator=torch.Generator().manual_seed(1))
        permuted = type(batch)(**{k: (v[perm] if hasattr(v, "shape") else v) for k, v in vars(batch).items()})
        adv_p, _ = estimator.advantages(permuted)
        torch.testing.assert_close(adv_p, adv[perm], atol=1e-5, rtol=1e-5)

    def test_group_baseline_invariant_to_group_shift(self, estimator):
        import torch

        if not getattr(estimator, "group_baseline", False):
            pytest.skip("not a group-baseline estimator")
        batch = self._batch(estimator)
        adv, _ = estimator.advantages(batch)
        shifted = type(batch)(**vars(batch))
        one_group = batch.group_index == batch.group_index[0]
        shifted.rewards = batch.rewards + 5.0 * one_group
        adv_s, _ = estimator.advantages(shifted)
        torch.testing.assert_close(adv_s, adv, atol=1e-4, rtol=1e-4)
