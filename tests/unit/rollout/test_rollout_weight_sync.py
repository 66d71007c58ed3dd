"""Weight updates: over a Gloo group from this process (WeightSender) and from disk; weight_version advances."""

from __future__ import annotations

import pytest

from posttrain.core.rollout.client import EngineClient
from posttrain.core.rollout.weight_sync import WeightSender
from posttrain.testing.engine import hf_greedy, start_local_engine as start_engine

PROMPT = [5, 6, 7, 8]
GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture
def own_engine(tiny_ckpt, tmp_path):
    server = start_engine(tiny_ckpt, str(tmp_path))
    yield server.base_url
    server.stop()


def _load(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.slow
async def test_gloo_update_gives_the_new_weights_output_then_disk_restores(own_engine, tiny_ckpt, tiny_ckpt_b, hf_model):
    import asyncio

    new_model = _load(tiny_ckpt_b)
    old_out, new_out = hf_greedy(hf_model, PROMPT, 10), hf_greedy(new_model, PROMPT, 10)
    assert old_out != new_out  # else the test could not tell the weights apart
    async with EngineClient(own_engine) as engine:
        before = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert before["output_ids"] == old_out

        sender = WeightSender([own_engine], backend="gloo")
        await asyncio.to_thread(sender.init)
        named = list(new_model.state_dict().items())
        buckets = [named[i:i + 7] for i in range(0, len(named), 7)]  # several buckets, several calls
        await asyncio.to_thread(sender.send, buckets, 5)
        after = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert after["output_ids"] == new_out
        assert after["meta_info"]["weight_version"] == "5"

        await asyncio.to_thread(sender.update_from_disk, str(tiny_ckpt), 6)
        restored = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert restored["output_ids"] == old_out and restored["meta_info"]["weight_version"] == "6"
        await asyncio.to_thread(sender.update_from_tensors, list(new_model.state_dict().items()), "7")
        again = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert again["output_ids"] == new_out and again["meta_info"]["weight_version"] == "7"
        await asyncio.to_thread(sender.destroy)


@pytest.mark.slow
async def test_bad_weight_updates_are_400s(own_engine, tmp_path):
    from posttrain.core.rollout.client import EngineRequestError

    async with EngineClient(own_engine) as engine:
        with pytest.raises(EngineRequestError, match="no \\*.safetensors"):
            await engine.update_weights_from_disk(str(tmp_path))
        with pytest.raises(EngineRequestError, match="init_weights_update_group first"):
            await engine.update_weights_from_distributed(["x"], ["float32"], [[1]])
        with pytest.raises(EngineRequestError, match="serialized_named_tensors"):
            await engine.request("POST", "/update_weights_from_tensor", {"serialized_named_tensors": "x"})
        assert await engine.get_weight_version() == "0"
        out = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out["meta_info"]["weight_version"] == "0"
