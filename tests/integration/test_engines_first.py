"""Engines that can wait for their checkpoint (``EngineBackend.waits_for_checkpoint``) start before the trainer
builds: the loop launches them on ``hf-init`` before it exists, and the trainer renames it into place whole.
Colocated runs start them first too; with the trainer offloaded the checkpoint appears only after the offload
(``test_components_in_loop``'s offload test checks that order). External engines are running already."""

from __future__ import annotations

import asyncio
import json
import math
import re

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _config(**sections):
    from posttrain.core.config import load_config
    from posttrain.core.plugins import load_plugins

    data = {
        "seed": 0, "model": {"name": "qwen3", "preset": "tiny", "dtype": "float32", "tokenizer": "char"},
        "data": {"path": str(ROOT / "examples" / "quickstart" / "prompts.jsonl"), "epochs": 10},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollouts": 1, "max_new_tokens": 2,
                    "seed_sampling": True, "use_router": True,
                    "engine": {"name": "local", "device": "cpu", "context_length": 64, "max_running_requests": 16}},
        "generator": "single_turn", "estimator": "grpo", "loss": "ppo_clip", "rewards": [{"name": "exact_match"}],
        "trainer": {"global_batch_size": 16, "micro_batch_size": 16, "lr": 1e-3,
                    "backend": {"name": "megatron", "sequence_packing": False}},
        "logging": {"tensorboard": False}, **sections}
    plugins = load_plugins(autoload=False)
    return load_config(None, data=data, plugins=plugins), plugins


@pytest.mark.parametrize("init_weights", [False, True], ids=["weights-from-push", "hf-init-weights"])
def test_the_engines_start_before_the_trainer_and_load_the_fresh_checkpoint(tmp_path, monkeypatch, init_weights):
    """The engine role is made (``model_pending``) before the trainer; an ``hf-init`` left by an earlier start of
    the run is gone before they launch (they would load it), and no ``hf-init.partial`` is left. By default
    ``hf-init`` holds the model's files alone, written before the trainer builds, and the engines read no weights
    (their first push gives them all); with ``checkpoint.hf_init_weights`` the trainer writes its weights there and
    the engines load them."""
    from posttrain.core.actors.engines import EngineRole
    from posttrain.core.actors.trainer import TrainerRole
    from posttrain.core.loop import train
    from posttrain.core.run_dir import RunDirectory

    events = []

    def record(cls, what):
        real = cls.__init__

        def init(self, *args, **kwargs):
            events.append(what(*args, **kwargs))
            real(self, *args, **kwargs)
        monkeypatch.setattr(cls, "__init__", init)

    run = RunDirectory(tmp_path / "run")
    stale = run.path / "hf-init" / "left-by-an-earlier-start"
    stale.parent.mkdir(parents=True)
    stale.write_text("x")
    init = run.path / "hf-init"

    def engines(config, model_path, log_dir, load_args=None, model_pending=False, weights_from_push=False, wait=None):
        return ("engines", model_pending, weights_from_push, init.exists())
    record(EngineRole, engines)
    record(TrainerRole, lambda *a, **k: ("trainer", (init / "config.json").is_file()))
    cfg, plugins = _config(checkpoint={"hf_init_weights": init_weights})
    asyncio.run(train(cfg, plugins, run))
    # without weights, hf-init is there before the trainer builds; with them, the trainer writes it
    assert events == [("engines", True, not init_weights, False), ("trainer", not init_weights)], events
    assert (init / "config.json").is_file() and (init / "tokenizer.json").is_file() and not stale.exists()
    assert any(init.glob("*.safetensors")) == init_weights
    assert not (run.path / "hf-init.partial").exists()
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and math.isfinite(rows[0]["train/loss"])
    assert rows[0]["train_rollout_logprob_abs_diff"] < 1e-3  # the engines serve the trainer's weights
    # the engine's log says how long each part of its start took, the wait for the checkpoint first
    logs = "".join(p.read_text() for p in run.path.rglob("engine*.log"))
    assert ("zero weights until the first push" in logs) == (not init_weights), logs[-2000:]
    ready = re.search(r"posttrain engine serving .* \(ready after ([\d.]+) s: waiting for the checkpoint ([\d.]+) s, "
                      r"model ([\d.]+) s, tokenizer ([\d.]+) s\)", logs)
    assert ready, logs[-2000:]
    age, *parts = map(float, ready.groups())
    assert age >= sum(parts) and parts[1] > 0  # (the wait may be 0: imports that outlast the build find it there)
    assert re.search(r"first generation \(the fleet's readiness check\) in [\d.]+ s", logs), logs[-2000:]

