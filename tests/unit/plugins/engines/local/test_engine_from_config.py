"""A local engine started without weights (``--load-format dummy``, a run's engines on ``hf-init``): the model built
from ``config.json`` alone, the tensors no update has written yet named, and ``/generate`` refused after a push that
left one unwritten, served once every one has been."""

from __future__ import annotations

import shutil

import pytest
import torch

from posttrain.core.rollout.client import EngineClient, EngineRequestError
from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning
from posttrain.testing.engine import start_local_engine


def _model_files(ckpt, out):
    """``ckpt`` without its weights: config.json and the tokenizer, as a run's hf-init."""
    out.mkdir()
    for f in ckpt.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def _weights(ckpt):
    from safetensors.torch import load_file

    return {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_a_runner_built_from_the_config_names_what_no_update_wrote(tiny_ckpt, tmp_path):
    files = _model_files(tiny_ckpt, tmp_path / "files")
    built = ModelRunner(files, max_slots=2, context_length=32, from_config=True)
    loaded = ModelRunner(tiny_ckpt, max_slots=2, context_length=32)
    every = {names[0] for names in built.required_weights()}
    assert set(built.unwritten_weights()) == every and loaded.unwritten_weights() == []
    weights = _weights(tiny_ckpt)
    first = sorted(weights)[:3]
    built.load_weights({k: weights[k] for k in first})
    assert set(built.unwritten_weights()) == every - set(first) and built.weight_updates == 1
    built.load_weights({k: v for k, v in weights.items() if k not in first})
    assert built.unwritten_weights() == []
    prompt = [[5, 6, 7, 8]]
    torch.testing.assert_close(built.prefill([0], prompt), loaded.prefill([0], prompt), atol=0, rtol=0)


def test_a_runner_built_from_the_config_starts_at_zero_with_its_output_layer_tied(tmp_path):
    """No random init (its weights all come from the first push): every parameter zero, never ``torch.empty``'s
    leftovers, and a tied output layer the embedding's own tensor, written by the one name a checkpoint holds."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    built = ModelRunner(_model_files(ckpt, tmp_path / "files"), max_slots=2, context_length=32, from_config=True)
    assert all(not p.any() for p in built.model.parameters())
    assert built.model.lm_head.weight.data_ptr() == built.model.model.embed_tokens.weight.data_ptr()
    weights = _weights(ckpt)
    assert "lm_head.weight" not in weights  # save_pretrained writes a tied tensor once
    built.load_weights(weights)
    assert built.unwritten_weights() == []
    prompt = [[5, 6, 7, 8]]
    loaded = ModelRunner(ckpt, max_slots=2, context_length=32)
    torch.testing.assert_close(built.prefill([0], prompt), loaded.prefill([0], prompt), atol=0, rtol=0)


def test_fused_projections_count_as_written_by_their_own_names(tiny_ckpt, tmp_path):
    """A GPU engine fuses Q/K/V and gate/up into one storage each: every part is a tensor of its own to write."""
    files = _model_files(tiny_ckpt, tmp_path / "files")
    built = ModelRunner(files, max_slots=2, context_length=32, from_config=True, tuning=RunnerTuning(fuse_projections=True))
    weights = _weights(tiny_ckpt)
    q = [k for k in weights if k.endswith("self_attn.q_proj.weight")]
    built.load_weights({k: v for k, v in weights.items() if k not in q})
    assert sorted(built.unwritten_weights()) == sorted(q)
    built.load_weights({k: weights[k] for k in q})
    assert built.unwritten_weights() == []


@pytest.mark.slow
async def test_the_server_refuses_to_generate_after_a_push_that_left_a_tensor_unwritten(tiny_ckpt, tmp_path):
    import asyncio

    from posttrain.core.rollout.weight_sync import WeightSender

    files = _model_files(tiny_ckpt, tmp_path / "files")
    (tmp_path / "logs").mkdir()
    server = start_local_engine(files, tmp_path / "logs", load_format="dummy")
    try:
        weights = _weights(tiny_ckpt)
        down = [k for k in weights if k.endswith("mlp.down_proj.weight")]
        sender = WeightSender([server.base_url], backend="gloo", api_key=server.api_key)
        greedy = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
        async with EngineClient(server.base_url, api_key=server.api_key) as engine:
            await engine.generate(input_ids=[5, 6, 7], sampling_params=greedy)  # random weights, before any push
            await asyncio.to_thread(sender.update_from_tensors, [(k, v) for k, v in weights.items() if k not in down], 1)
            with pytest.raises(EngineRequestError, match=f"{len(down)} of its tensors: .*down_proj"):
                await engine.generate(input_ids=[5, 6, 7], sampling_params=greedy)
            await asyncio.to_thread(sender.update_from_tensors, [(k, weights[k]) for k in down], 1)
            served = await engine.generate(input_ids=[5, 6, 7], sampling_params=greedy)
        reference = start_local_engine(tiny_ckpt, tmp_path / "logs")
        try:
            async with EngineClient(reference.base_url, api_key=reference.api_key) as engine:
                expected = await engine.generate(input_ids=[5, 6, 7], sampling_params=greedy)
        finally:
            reference.stop()
        assert served["output_ids"] == expected["output_ids"]
    finally:
        server.stop()
