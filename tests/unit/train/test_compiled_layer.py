"""``trainers/megatron/compiled.py``: compiled transformer layers get their input in one layout, and the packed
token count symbolic from the first call, so Dynamo compiles fewer versions of each frame."""

from __future__ import annotations

import torch

from posttrain.plugins.trainers.megatron import compiled
from tests.unit.train.test_trainer import _batch, _trainer

REAL_COMPILE = torch.compile  # each count below patches torch.compile over it


def test_a_one_sample_batch_gets_the_standard_layout_as_a_view():
    embedded = torch.randn(1, 7, 16)  # [b, s, h], transposed to [s, b, h] as Megatron's embedding does
    hidden = embedded.transpose(0, 1)
    assert hidden.stride() == (16, 112, 1)  # a size-1 dimension's stride: s * h here, h out of a layer
    std = compiled._standard(hidden)
    assert std.stride() == (16, 16, 1) and std.data_ptr() == hidden.data_ptr() and torch.equal(std, hidden)
    batch = torch.randn(7, 3, 16).transpose(0, 1).transpose(0, 1)  # b = 3: its strides are kept
    assert compiled._standard(batch).stride() == batch.stride()


def _frames(tiny_ckpts, monkeypatch, wrap) -> int:
    """Compiles (Dynamo's counting backend) for three packed batches through a compiled trainer's layers, each
    layer compiled by ``wrap(forward, symbolic_tokens)``; checks the log-probs against the uncompiled trainer."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: REAL_COMPILE(fn, **{**kw, "backend": counter}))
    monkeypatch.setattr("posttrain.plugins.trainers.megatron.trainer.compiled_layer", wrap)
    options = {"sequence_packing": True, "attention": "sdpa"}
    trainer, plain = _trainer(tiny_ckpts, compile=True, **options), _trainer(tiny_ckpts, **options)
    for seed in (7, 8, 9):
        _, batch = _batch(seed=seed)
        torch.testing.assert_close(trainer.log_probs(batch)[0], plain.log_probs(batch)[0], atol=1e-5, rtol=1e-5)
    return counter.frame_count


def test_compiled_layers_compile_fewer_versions_than_plain_torch_compile(tiny_ckpts, monkeypatch):
    """The first layer's input (the embedding's transposed view) and every later layer's differ only in the stride
    of the size-1 batch dimension, and each packed micro-batch has another token count: plain ``torch.compile``
    compiled each frame for both layouts, static and then symbolic."""
    ours = _frames(tiny_ckpts, monkeypatch, compiled.compiled_layer)
    plain = _frames(tiny_ckpts, monkeypatch, lambda forward, symbolic_tokens: torch.compile(forward))
    assert 0 < ours < plain, (ours, plain)
