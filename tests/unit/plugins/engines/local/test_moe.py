"""The local engine serving MoE checkpoints (Qwen3-MoE, GLM-4.5 shapes): forward passes against HF's,
greedy generation against HF ``generate``, the routed experts it reports against HF's own router, and
weight updates under checkpoint (per-expert) names."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch

from posttrain.plugins.engines.local.model_runner import ModelRunner


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory):
    from posttrain.testing.tiny import make_tiny_checkpoint

    return {f: make_tiny_checkpoint(tmp_path_factory.mktemp(f) / f, family=f, seed=3) for f in ("qwen3_moe", "glm4_moe")}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_routing(model, ids: list[int]) -> np.ndarray:
    """``[len(ids), L, k]`` expert ids HF's own routers pick for ``ids`` (-1 in dense layers)."""
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    out = np.full((len(ids), layers, k), -1, dtype=np.int32)
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o, l=l: out.__setitem__((slice(None), l), o[2].numpy()))
             for l, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_prefill_and_decode_match_hf_and_report_hf_routing(moe_ckpts, family):
    torch.set_num_threads(1)
    r = ModelRunner(moe_ckpts[family], max_slots=4, context_length=64)
    hf = hf_model(moe_ckpts[family])
    prompts = {0: [5, 6, 7, 8, 9], 2: [10, 11, 40]}  # slot 1 idle
    logits = r.prefill(list(prompts), list(prompts.values()))
    for row, (slot, p) in enumerate(prompts.items()):
        with torch.no_grad():
            torch.testing.assert_close(logits[row], hf(torch.tensor([p])).logits[0, -1], atol=1e-4, rtol=1e-4)
        got = np.sort(r.routed_experts[row, : len(p)].numpy(), axis=-1)
        assert (got == np.sort(hf_routing(hf, p), axis=-1)).all()
    seqs = {s: p + [int(logits[i].argmax())] for i, (s, p) in enumerate(prompts.items())}
    shared = r.prefill([1, 3], [prompts[0], prompts[0]])  # one prompt twice: run once, routed for both
    first = r.routed_experts
    for row in (0, 1):
        torch.testing.assert_close(shared[row], logits[0], atol=1e-5, rtol=1e-5)
        assert (np.sort(first[row, :5].numpy(), axis=-1) == np.sort(hf_routing(hf, prompts[0]), axis=-1)).all()
    r.prefill(list(prompts), list(prompts.values()))  # the state the decode below starts from
    for _ in range(3):
        tokens = torch.tensor([seqs[0][-1], 0, seqs[2][-1]])
        positions = torch.tensor([len(seqs[0]) - 1, 0, len(seqs[2]) - 1])
        out = r.decode(tokens, positions)
        for slot in (0, 2):
            with torch.no_grad():
                torch.testing.assert_close(out[slot], hf(torch.tensor([seqs[slot]])).logits[0, -1], atol=1e-4, rtol=1e-4)
            expect = np.sort(hf_routing(hf, seqs[slot])[-1], axis=-1)
            assert (np.sort(r.routed_experts[slot].numpy(), axis=-1) == expect).all()
            seqs[slot].append(int(out[slot].argmax()))


def test_checkpoint_expert_names_load_into_stacked_experts(moe_ckpts):
    """Trainers send experts one tensor each (``mlp.experts.<e>.gate_proj.weight``); the model keeps them
    stacked. Loading a whole checkpoint that way into a zeroed model gives HF's logits back."""
    from safetensors.torch import load_file

    path = moe_ckpts["glm4_moe"]
    r = ModelRunner(path, max_slots=1, context_length=32)
    with torch.no_grad():
        for p in r.model.parameters():
            p.zero_()
    named = load_file(str(path / "model.safetensors"))
    assert any(".mlp.experts.7.up_proj.weight" in n for n in named)
    assert r.load_weights(named, require_all=True) == len(named)  # per-expert names cover the stacked experts
    ids = torch.tensor([[3, 9, 27, 81, 4]])
    with torch.no_grad():
        assert torch.equal(r.model(ids).logits, hf_model(path)(ids).logits)
    # rollout.check_weights: the engine's checksums name the per-expert tensors the trainer pushed
    from posttrain.core.rollout.weight_check import first_mismatch

    report = {"checksums": r.weight_checksums(), "dtype": "float32"}
    assert first_mismatch([sorted(named.items())], report) is None
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert first_mismatch([[(name, named[name] + 1e-3)]], report) == \
        f"tensor {name}: its float32 bytes differ from what was pushed"
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.1.mlp.experts.8.up_proj.weight'"):
        r.load_weights({"model.layers.1.mlp.experts.8.up_proj.weight": named[
            "model.layers.1.mlp.experts.7.up_proj.weight"]})  # 8 experts: no expert 8


@pytest.mark.slow
async def test_server_greedy_matches_hf_generate_and_returns_sglang_routed_experts(moe_ckpts, tmp_path):
    from posttrain.core.rollout.client import EngineClient
    from posttrain.testing.engine import hf_greedy, start_local_engine

    path = moe_ckpts["qwen3_moe"]
    hf = hf_model(path)
    server = start_local_engine(path, tmp_path)
    prompts = [[5, 6, 7, 8], [30, 31], [9, 10, 11, 12, 13, 14]]
    try:
        async with EngineClient(server.base_url, api_key=server.api_key) as engine:
            outs = await asyncio.gather(*[engine.generate(
                input_ids=p, sampling_params={"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
                return_routed_experts=True) for p in prompts])
            plain = await engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2})
    finally:
        server.stop()
    assert "routed_experts" not in plain["meta_info"]  # only when asked
    for p, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(hf, p, 6)
        read = p + out["output_ids"][:-1]  # every token the model read: SGLang's [prompt + output - 1, L, k]
        routed = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        routed = routed.reshape(len(read), hf.config.num_hidden_layers, hf.config.num_experts_per_tok)
        assert (np.sort(routed, axis=-1) == np.sort(hf_routing(hf, read), axis=-1)).all()
