"""``trainers/megatron/compiled.py``: compiled transformer layers get their input in one layout, the packed
token count symbolic from the first call, and Megatron's group lookups without their graph-breaking warning,
so Dynamo compiles fewer frames and fewer versions of each."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from posttrain.plugins.trainers.megatron import compiled

from tests.unit.plugins.trainers.megatron.test_trainer import _batch, _trainer

REAL_COMPILE = torch.compile  # each count below patches torch.compile over it
options_seen: list = []  # the Inductor options of each compile in the last count


def test_a_one_sample_batch_gets_the_standard_layout_in_its_own_memory_and_not_as_a_view():
    embedded = torch.randn(1, 7, 16, requires_grad=True)  # [b, s, h], transposed to [s, b, h] as Megatron's embedding does
    hidden = embedded.transpose(0, 1)
    assert hidden.stride() == (16, 112, 1)  # a size-1 dimension's stride: s * h here, h out of a layer
    std = compiled._standard(hidden)
    assert std.stride() == (16, 16, 1) and std.data_ptr() == hidden.data_ptr() and torch.equal(std, hidden)
    assert std._base is None  # Dynamo guards on a view's base: the embedding's is unlike every later layer's input
    (std * torch.arange(16.0)).sum().backward()  # the gradient reaches the embedding unchanged
    assert torch.equal(embedded.grad, torch.arange(16.0).expand(1, 7, 16))
    fresh = torch.randn(7, 1, 16)  # a layer's output: already standard and not a view, handed on as it is
    assert compiled._standard(fresh) is fresh
    with torch.no_grad():  # a log-prob pass
        view = compiled._standard(torch.randn(1, 7, 16).transpose(0, 1))
    assert view._base is None and view.stride() == (16, 16, 1) and not view.requires_grad
    batch = torch.randn(7, 3, 16).transpose(0, 1).transpose(0, 1)  # b = 3: its strides are kept
    assert compiled._standard(batch).stride() == batch.stride()


def test_the_layers_compile_without_the_mix_order_reductions_size_guard():
    """Strict mix-order reductions guard the symbolic token count (``5120 <= tokens`` at Qwen3-1.7B on an H100):
    a step's small last micro-batch then recompiled every layer. The option is one this torch knows."""
    import torch._inductor.config as inductor

    options = compiled.inductor_options()
    assert options == {"triton.mix_order_reduction_non_strict_mode": True}
    assert inductor.triton.mix_order_reduction_non_strict_mode is False  # torch's default, which the layers change


@pytest.fixture
def megatron_lookups(monkeypatch):
    """Megatron's modules get their own ``get_tensor_model_parallel_group_if_none`` back after the test, and
    ``restore()`` gives it back at once (so a count starts from Megatron as installed, whatever ran before)."""
    from megatron.core import utils

    import posttrain.plugins.trainers.megatron.trainer  # noqa: F401 - every module the trainer uses is loaded

    now = utils.get_tensor_model_parallel_group_if_none
    original = getattr(now, "original", now)  # an earlier compiled trainer's quiet version
    holders = [m for n, m in list(sys.modules.items()) if n.startswith("megatron.")
               and getattr(m, "get_tensor_model_parallel_group_if_none", None) in (now, original)]
    for module in holders:
        monkeypatch.setattr(module, "get_tensor_model_parallel_group_if_none", original)

    def restore():
        for module in holders:
            module.get_tensor_model_parallel_group_if_none = original
    return restore


def _frames(tiny_ckpts, monkeypatch, wrap, restore) -> int:
    """Compiles (Dynamo's counting backend) for three packed batches through a compiled trainer's layers, each
    layer compiled by ``wrap(forward, symbolic_tokens)``; checks the log-probs against the uncompiled trainer."""
    from torch._dynamo.testing import CompileCounter

    restore()
    torch._dynamo.reset()
    counter = CompileCounter()
    options_seen.clear()  # Inductor's options (the counting backend takes none)
    monkeypatch.setattr(torch, "compile", lambda fn, options=None, **kw: (
        options_seen.append(options), REAL_COMPILE(fn, **{**kw, "backend": counter}))[1])
    monkeypatch.setattr("posttrain.plugins.trainers.megatron.trainer.compiled_layer", wrap)
    options = {"sequence_packing": True, "attention": "sdpa"}
    trainer, plain = _trainer(tiny_ckpts, compile=True, **options), _trainer(tiny_ckpts, **options)
    for seed in (7, 8, 9):
        _, batch = _batch(seed=seed)
        torch.testing.assert_close(trainer.log_probs(batch)[0], plain.log_probs(batch)[0], atol=1e-5, rtol=1e-5)
    assert options_seen and all(o == compiled.inductor_options() for o in options_seen if wrap is compiled.compiled_layer)
    return counter.frame_count


def test_compiled_layers_compile_fewer_versions_than_plain_torch_compile(tiny_ckpts, monkeypatch, megatron_lookups):
    """The first layer's input (the embedding's transposed view) and every later layer's differ only in the stride
    of the size-1 batch dimension, and each packed micro-batch has another token count: plain ``torch.compile``
    compiled each frame for both layouts, static and then symbolic."""
    monkeypatch.setattr(compiled, "quiet_group_lookups", lambda: 0)  # this lever alone (the next test: the other)
    ours = _frames(tiny_ckpts, monkeypatch, compiled.compiled_layer, megatron_lookups)
    plain = _frames(tiny_ckpts, monkeypatch, lambda forward, symbolic_tokens: torch.compile(forward), megatron_lookups)
    assert 0 < ours < plain, (ours, plain)


def test_megatron_group_lookups_break_no_compiled_layer(tiny_ckpts, monkeypatch, megatron_lookups):
    """Megatron's row-parallel projections ask for the default tensor-parallel group at every call, and the
    deprecation warning it raises on rank 0 is a graph break (twice a layer): without it each layer compiles
    fewer frames, and the trainer computes the same log-probs (checked in ``_frames``) and warns no more."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet = _frames(tiny_ckpts, monkeypatch, compiled.compiled_layer, megatron_lookups)
    assert not [w for w in caught if "tp_group is None" in str(w.message)]
    monkeypatch.setattr(compiled, "quiet_group_lookups", lambda: 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loud = _frames(tiny_ckpts, monkeypatch, compiled.compiled_layer, megatron_lookups)
    assert [w for w in caught if "tp_group is None" in str(w.message)], "the lever has nothing left to remove"
    assert 0 < quiet < loud, (quiet, loud)
