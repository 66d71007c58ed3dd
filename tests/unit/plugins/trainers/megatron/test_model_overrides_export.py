"""A preset cut by ``model.overrides`` is the same cut model for the trainer and, through the trainer's HF
export (the run's ``hf-init``, which the engines start from), for the local engine."""

from __future__ import annotations

import json

import torch


def test_cut_moe_preset_trains_exports_and_serves_with_the_cut(megatron_tp1, tmp_path):
    from safetensors import safe_open

    from posttrain.core.config import TrainerConfig
    from posttrain.core.plugins import load_plugins
    from posttrain.core.train_batch import TrainBatch
    from posttrain.plugins.engines.local.model_runner import ModelRunner
    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

    cls = load_plugins().registry("model")["qwen3_moe"]
    assert cls.presets["tiny"]["num_hidden_layers"] > 1
    spec = cls(cls.Config(preset="tiny", dtype="float32", overrides={"num_hidden_layers": 1, "num_experts": 6}))
    trainer = MegatronTrainer(spec, TrainerConfig(micro_batch_size=2, global_batch_size=2))
    assert len(trainer.model.decoder.layers) == 1
    out = trainer.save_hf(str(tmp_path / "hf-init"))
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["num_experts"] == 6
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert not [n for n in names if n.startswith("model.layers.1.")]
    assert {n.split(".")[5] for n in names if ".mlp.experts." in n} == {str(e) for e in range(6)}

    runner = ModelRunner(out, device="cpu", dtype="float32", max_slots=2, context_length=16)
    assert runner.num_layers == 1 and runner.moe_top_k == cls.presets["tiny"]["num_experts_per_tok"]
    ids = [3, 5, 7, 9, 11, 2]
    _, (engine_lp,) = runner.prefill_scored([0], [ids], [0])
    batch = TrainBatch.from_lists([ids], [len(ids) - 1])
    trainer_lp = trainer.log_probs(batch)[0][0, 1:]
    assert torch.allclose(torch.tensor(engine_lp), trainer_lp, atol=1e-4)  # one model on both sides
