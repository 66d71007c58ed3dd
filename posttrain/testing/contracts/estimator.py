"""The estimator contract: shapes, masks, purity, input checks and group invariances.

The rules, for every estimator (``advantages(batch) -> (advantages, returns)``, both ``[B, T]``):

- finite, exactly 0 outside ``response_mask``; the batch is not mutated; permuting samples permutes the
  result; ``group_baseline = True`` means a constant added to one group's rewards changes nothing;
- padding may hold NaN (``values``, ``token_rewards``, log-probs outside the mask): it never leaks;
- a NaN or inf reward, or a NaN ``token_rewards`` entry on a response token, raises ``ValueError``
  naming the sample (never a NaN advantage);
- dense ``token_rewards`` (the KL penalty in the reward, reward shaping) change the result: an estimator
  never ignores them silently (estimators whose ``needs.teacher`` is set, whose signal is the teacher's, are exempt);
- ``rewards``/``group_index`` that are not ``[B]`` and ``token_rewards``/``values`` that are not ``[B, T]``
  raise ``ValueError`` naming the tensor and its shape.

``posttrain.core.group_stats.check_batch`` does the input checks in one call (the built-ins use it).
"""

from __future__ import annotations

import pytest

from posttrain.core.interfaces import needs_of
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
        return make_batch(critic=needs_of(estimator).critic, **kw)

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

    @pytest.mark.parametrize("bad", [float("nan"), float("inf")])
    def test_non_finite_reward_raises_naming_the_sample(self, estimator, bad):
        batch = self._batch(estimator)
        batch.rewards = batch.rewards.clone()
        batch.rewards[2] = bad
        with pytest.raises(ValueError) as info:
            estimator.advantages(batch)
        assert "2" in str(info.value), f"the error should name sample 2: {info.value}"

    def test_nan_token_reward_on_a_response_token_raises(self, estimator):
        import torch

        batch = self._batch(estimator)
        batch.token_rewards = torch.zeros_like(batch.response_mask)
        batch.token_rewards[4, 0] = float("nan")  # every sample has at least one response token
        with pytest.raises(ValueError):
            estimator.advantages(batch)

    def test_token_rewards_are_never_silently_ignored(self, estimator):
        """Dense token rewards (a KL penalty in the reward) must change the result."""
        import torch

        if needs_of(estimator).teacher:
            pytest.skip("learns from a teacher's log-probs (needs.teacher), not from rewards")
        batch = self._batch(estimator)
        adv, ret = estimator.advantages(batch)
        gen = torch.Generator().manual_seed(2)
        batch.token_rewards = torch.randn(batch.response_mask.shape, generator=gen) * batch.response_mask
        adv_t, ret_t = estimator.advantages(batch)
        assert not (torch.allclose(adv_t, adv) and torch.allclose(ret_t, ret)), "token_rewards were ignored"

    def test_wrong_shapes_raise_a_clear_error(self, estimator):
        import torch

        batch = self._batch(estimator)
        batch.rewards = batch.rewards[:-1]
        with pytest.raises(ValueError, match="rewards"):
            estimator.advantages(batch)
        batch = self._batch(estimator)
        batch.token_rewards = torch.zeros(3, 3)
        with pytest.raises(ValueError, match="token_rewards"):
            estimator.advantages(batch)
