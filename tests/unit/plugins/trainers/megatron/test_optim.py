"""The foreach stand-ins for Apex's multi-tensor ops that Megatron's optimizer and grad clipping call."""

from __future__ import annotations

import torch

from posttrain.plugins.trainers.megatron.optim import (foreach_copy_this_to_that, foreach_l2_norm, foreach_scale,
                                                      use_foreach_multi_tensor)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(7, 5, generator=g), torch.randn(0), torch.randn(33, generator=g), torch.randn(2, 3, 4, generator=g)]


def test_l2_norm_is_the_norm_of_all_tensors_together():
    tensors = _tensors()
    flag = torch.zeros(1, dtype=torch.int)
    total, per = foreach_l2_norm(2048, flag, [tensors], False)
    expected = torch.cat([t.flatten() for t in tensors]).double().norm()
    assert total.shape == (1,) and total.dtype == torch.float32 and per is None
    assert abs(float(total) - float(expected)) < 1e-5 * float(expected)
    _, per = foreach_l2_norm(2048, flag, [tensors], True)
    assert torch.allclose(per, torch.stack([t.norm() for t in tensors if t.numel()]))
    assert float(foreach_l2_norm(2048, flag, [[]], False)[0]) == 0.0


def test_scale_copies_casts_and_scales_in_place():
    src = _tensors()
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    foreach_scale(2048, None, [src, dst], 1.0)
    assert all(torch.equal(d, s.to(torch.bfloat16)) for s, d in zip(src, dst))
    foreach_scale(2048, None, [src, dst], 0.5)
    assert all(torch.equal(d, (s * 0.5).to(torch.bfloat16)) for s, d in zip(src, dst))
    before = [t.clone() for t in src]
    foreach_scale(2048, None, [src, src], 0.25)
    assert all(torch.equal(t, b * 0.25) for t, b in zip(src, before))


def test_megatron_binds_the_foreach_ops():
    from megatron.core.optimizer import clip_grads, optimizer

    use_foreach_multi_tensor()
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale and optimizer.multi_tensor_scale_impl is foreach_scale
    assert optimizer._multi_tensor_copy_this_to_that is foreach_copy_this_to_that
    src = _tensors()
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    optimizer._multi_tensor_copy_this_to_that(this=src, that=dst, overflow_buf=None)
    assert all(torch.equal(d, s.to(torch.bfloat16)) for s, d in zip(src, dst))
    assert use_foreach_multi_tensor() is False  # already bound: nothing left to bind
