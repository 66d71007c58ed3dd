"""``core.hf_init``: the model files a run's engines start from, written from the model spec alone, are the ones
the trainer's own HF checkpoint holds (its ``config.json`` and tokenizer), and appear whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.core.hf_init import HF_EXTRA_FILES, write_model_files


def _spec(**model):
    from posttrain.core.config import load_config
    from posttrain.core.plugins import load_plugins
    from tests.conftest import ROOT

    data = {"model": {"name": "qwen3", "preset": "tiny", "tokenizer": "char", **model},
            "data": {"path": str(ROOT / "examples" / "quickstart" / "prompts.jsonl")},
            "generator": "single_turn", "estimator": "grpo", "loss": "ppo_clip", "rewards": [{"name": "exact_match"}],
            "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 2},
            "trainer": {"global_batch_size": 4, "micro_batch_size": 4, "backend": {"name": "megatron"}}}
    plugins = load_plugins(autoload=False)
    cfg = load_config(None, data=data, plugins=plugins)
    return cfg, plugins, cfg.model.create(plugins)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_files_are_those_of_the_trainers_checkpoint(tmp_path, dtype):
    from posttrain.core.actors.trainer import TrainerRole

    cfg, plugins, spec = _spec(dtype=dtype, overrides={"num_hidden_layers": 1})
    files = write_model_files(spec, tmp_path / "hf-init")
    trainer = TrainerRole(cfg.to_dict(), {"autoload": False})
    full = trainer.save_hf(str(tmp_path / "full"))
    written = {p.name for p in files.iterdir()}
    assert written == {p.name for p in (tmp_path / "full").iterdir() if p.suffix != ".safetensors"}
    assert json.loads((files / "config.json").read_text()) == json.loads((tmp_path / "full" / "config.json").read_text())
    assert json.loads((files / "config.json").read_text())["torch_dtype"] == dtype
    for name in written - {"config.json"}:
        assert (files / name).read_bytes() == (Path(full) / name).read_bytes(), name


def test_they_appear_whole_in_place_of_what_was_there(tmp_path):
    _, _, spec = _spec()
    out = tmp_path / "hf-init"
    out.mkdir()
    (out / "model.safetensors").write_text("an earlier start's")
    write_model_files(spec, out)
    assert not (out / "model.safetensors").exists() and (out / "config.json").is_file()
    assert not (tmp_path / "hf-init.partial").exists()


def test_a_checkpoints_companion_files_come_along(tmp_path):
    """From ``model.path``: its config (with ``model.overrides``), tokenizer, generation config and chat template."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    _, _, spec = _spec(path=str(ckpt), tokenizer=None, overrides={"max_position_embeddings": 64})
    files = write_model_files(spec, tmp_path / "hf-init")
    source = json.loads((ckpt / "config.json").read_text())
    config = json.loads((files / "config.json").read_text())
    assert config["max_position_embeddings"] == 64 and config["hidden_size"] == source["hidden_size"]
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    for name in HF_EXTRA_FILES:
        assert (files / name).is_file() == (ckpt / name).is_file(), name
    assert (files / "generation_config.json").read_text() == (ckpt / "generation_config.json").read_text()
    assert not list(files.glob("*.safetensors"))
