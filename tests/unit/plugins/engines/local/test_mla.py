"""The local engine serving DeepSeek-V3 (multi-head latent attention over a latent cache, group-limited
sigmoid routing): prefill and decode logits and routed experts against HF's, greedy output equal to HF
``generate``, and the cache holding one ``kv_lora_rank + qk_rope_head_dim`` row per token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posttrain.plugins.engines.local.model_runner import ModelRunner


YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4, "beta_fast": 1, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 50000.0}


@pytest.fixture(scope="module")
def dsv3_ckpt(tmp_path_factory):
    from posttrain.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("dsv3") / "ckpt", family="deepseek_v3", seed=3)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_routing(model, ids: list[int]) -> np.ndarray:
    """``[len(ids), L, k]`` sorted expert ids of HF's own routers (-1 in dense layers)."""
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    out = np.full((len(ids), layers, k), -1, dtype=np.int32)
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o, l=l: out.__setitem__((slice(None), l), o[2].numpy()))
             for l, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return np.sort(out, axis=-1)


@pytest.mark.parametrize("yarn", [False, True])
def test_latent_cache_prefill_and_decode_match_hf(dsv3_ckpt, tmp_path, yarn):
    """With and without YaRN (Kimi-K2's parameters at a tiny original context: HF's rotary tables and softmax
    scale carry it)."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    torch.set_num_threads(1)
    path = dsv3_ckpt if not yarn else make_tiny_checkpoint(tmp_path / "yarn", family="deepseek_v3", seed=3,
                                                           rope_parameters=YARN)
    r = ModelRunner(path, max_slots=4, context_length=64)
    hf = hf_model(path)
    assert r.mla is not None and r.k_cache.shape == (4, 4, 1, 64, 32 + 8)
    assert r.v_cache.data_ptr() == r.k_cache.data_ptr() and r.v_cache.shape[-1] == 32  # no memory of its own
    prompts = {0: [5, 6, 7, 8, 9], 2: [10, 11, 40]}  # slot 1 idle
    logits = r.prefill(list(prompts), list(prompts.values()))
    seqs = {}
    for row, (slot, p) in enumerate(prompts.items()):
        with torch.no_grad():
            torch.testing.assert_close(logits[row], hf(torch.tensor([p])).logits[0, -1], atol=1e-5, rtol=1e-5)
        assert (np.sort(r.routed_experts[row, : len(p)].numpy(), axis=-1) == hf_routing(hf, p)).all()
        assert (r.routed_experts[row, :, 0] == -1).all()  # the dense first layer
        seqs[slot] = p + [int(logits[row].argmax())]
    for _ in range(4):
        tokens = torch.tensor([seqs[0][-1], 0, seqs[2][-1]])
        positions = torch.tensor([len(seqs[0]) - 1, 0, len(seqs[2]) - 1])
        out = r.decode(tokens, positions)
        for slot in (0, 2):
            with torch.no_grad():
                torch.testing.assert_close(out[slot], hf(torch.tensor([seqs[slot]])).logits[0, -1], atol=1e-5, rtol=1e-5)
            assert (np.sort(r.routed_experts[slot].numpy(), axis=-1) == hf_routing(hf, seqs[slot])[-1]).all()
            seqs[slot].append(int(out[slot].argmax()))


def test_greedy_generation_equals_hf_generate(dsv3_ckpt):
    """Two prompts decoded side by side (one shared twice: prefilled once) for 8 tokens each."""
    from posttrain.testing.engine import hf_greedy

    torch.set_num_threads(1)
    r = ModelRunner(dsv3_ckpt, max_slots=3, context_length=64)
    hf = hf_model(dsv3_ckpt)
    prompts = [[3, 14, 15, 92, 65], [27, 18], [3, 14, 15, 92, 65]]
    logits = r.prefill([0, 1, 2], prompts)
    seqs = [p + [int(logits[i].argmax())] for i, p in enumerate(prompts)]
    for _ in range(7):
        out = r.decode(torch.tensor([s[-1] for s in seqs]), torch.tensor([len(s) - 1 for s in seqs]))
        for i, s in enumerate(seqs):
            s.append(int(out[i].argmax()))
    for p, s in zip(prompts, seqs):
        assert s[len(p):] == hf_greedy(hf, p, 8)


def test_stable_memory_release_and_resume_keep_the_latent_cache_working(dsv3_ckpt):
    """Colocated GPU engines keep weights and cache at fixed addresses (``memory.make_stable``; the CUDA driver
    stood in for on the CPU): the latent cache and its narrower values move, release and come back, and the
    model decodes as before, bit for bit."""
    from posttrain.plugins.engines.local.memory import EngineMemory
    from tests.unit.plugins.engines.local.test_memory import StandInDriver, _decode_logits

    torch.set_num_threads(1)
    r = ModelRunner(dsv3_ckpt, max_slots=2, context_length=32)
    before = _decode_logits(r).clone()
    mem = EngineMemory(r)
    assert mem.make_stable(StandInDriver().buffer) is None
    assert r.k_cache.shape[-1] == 40 and r.v_cache.shape[-1] == 32
    torch.testing.assert_close(_decode_logits(r), before, rtol=0, atol=0)
    mem.release({"weights", "kv_cache"})
    mem.resume({"weights", "kv_cache"})
    assert int(r.k_cache.count_nonzero()) == 0
    torch.testing.assert_close(_decode_logits(r), before, rtol=0, atol=0)
