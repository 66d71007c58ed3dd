"""Fused Q/K/V and gate/up matmuls in the local engine (``ModelRunner(fuse_projections=True)``, the GPU
default): the same forward passes as the modules one by one, the same names, weights and checks for
weight updates, kept across a stable memory release, and a fallback where a release split the blocks."""

from __future__ import annotations

import pytest
import torch

from posttrain.plugins.engines.local.fused import layer_parts
from posttrain.plugins.engines.local.memory import EngineMemory
from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning

FAMILIES = ["qwen3", "qwen2", "llama", "glm4", "qwen3_moe"]  # qwen2 and glm4 have q/k/v biases


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from posttrain.testing.tiny import make_tiny_checkpoint

    return {f: make_tiny_checkpoint(tmp_path_factory.mktemp(f) / f, family=f, seed=5) for f in FAMILIES}


def passes(r: ModelRunner) -> list[torch.Tensor]:
    """A prefill of two prompts (one of them scored), then two decode steps: every logit row."""
    logits, scored = r.prefill_scored([0, 1], [[3, 4, 5, 6], [7, 8]], [0, None])
    out = [logits.clone(), torch.tensor(scored[0])]
    for step in range(2):
        out.append(r.decode(torch.tensor([9 + step, 10 + step]), torch.tensor([4 + step, 2 + step])).clone())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_passes_equal_the_modules_one_by_one(ckpts, family):
    torch.manual_seed(0)
    plain = ModelRunner(ckpts[family], max_slots=2, context_length=32, tuning=RunnerTuning(fuse_projections=False))
    fused = ModelRunner(ckpts[family], max_slots=2, context_length=32, tuning=RunnerTuning(fuse_projections=True))
    assert plain.fused_groups == 0
    dense = sum(not hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate_proj") for layer in fused.layers)
    assert fused.fused_groups == len(fused.layers) + dense  # Q/K/V everywhere, gate/up in dense SwiGLU MLPs
    qkv, _ = layer_parts(fused.layers[0])
    assert qkv is not None and qkv.weight.data_ptr() == fused.layers[0].self_attn.q_proj.weight.data_ptr()
    for a, b in zip(passes(fused), passes(plain)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert list(fused.named_weights()) == list(plain.named_weights())
    assert fused.weight_checksums() == plain.weight_checksums()


def test_weight_updates_reach_the_fused_matmul_and_a_partial_checkpoint_is_refused(ckpts, tiny_ckpt_b):
    from safetensors.torch import load_file

    fused = ModelRunner(ckpts["qwen3"], max_slots=2, context_length=32, tuning=RunnerTuning(fuse_projections=True))
    other = load_file(str(tiny_ckpt_b / "model.safetensors"))
    assert fused.load_weights(other, require_all=True) == len(other)
    reference = ModelRunner(tiny_ckpt_b, max_slots=2, context_length=32, tuning=RunnerTuning(fuse_projections=False))
    for a, b in zip(passes(fused), passes(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert layer_parts(fused.layers[0])[0] is not None  # copied in place: still one block
    # q/k/v share one storage now: a checkpoint without k_proj must still count as incomplete
    partial = {n: t for n, t in other.items() if "layers.0.self_attn.k_proj" not in n}
    with pytest.raises(ValueError, match="missing model.layers.0.self_attn.k_proj.weight"):
        fused.load_weights(partial, require_all=True)


def test_stable_memory_keeps_the_blocks_fused(ckpts):
    from tests.unit.plugins.engines.local.test_memory import StandInDriver

    r = ModelRunner(ckpts["qwen2"], max_slots=2, context_length=32, tuning=RunnerTuning(fuse_projections=True))
    before = passes(r)
    mem = EngineMemory(r)
    assert mem.make_stable(StandInDriver().buffer) is None
    mem.release({"weights", "kv_cache"})
    mem.resume({"weights", "kv_cache"})
    qkv, gate_up = layer_parts(r.layers[1])
    assert qkv is not None and qkv.bias is not None and gate_up is not None
    for a, b in zip(passes(r), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_blocks_split_apart_run_one_by_one(ckpts):
    """A plain-path release re-allocates every parameter alone: the layer then runs its modules."""
    r = ModelRunner(ckpts["qwen3"], max_slots=2, context_length=32, tuning=RunnerTuning(fuse_projections=True))
    before = passes(r)
    attn, mlp = r.layers[0].self_attn, r.layers[0].mlp
    attn.k_proj.weight.data = attn.k_proj.weight.data.clone()
    mlp.up_proj.weight.data = mlp.up_proj.weight.data.clone()
    assert layer_parts(r.layers[0]) == (None, None) and layer_parts(r.layers[1])[0] is not None
    with torch.no_grad():
        attn.k_proj.weight.mul_(0.5)  # only the module's own (split) tensor sees this
    changed = passes(r)
    assert not torch.allclose(changed[0], before[0])
    with torch.no_grad():
        attn.k_proj.weight.mul_(2.0)
    for a, b in zip(passes(r), before):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
