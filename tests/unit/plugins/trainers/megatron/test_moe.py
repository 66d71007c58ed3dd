"""MoE model specs (Qwen3-MoE, GLM-4.5) on Megatron: presets, HF <-> Megatron conversion against
``transformers`` at TP=1, TP=2 and EP=2, the trainer under expert parallelism (EP x DP == one process),
load-balancing metrics, and routing replay (R3) closing the train/rollout gap of a perturbed router."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.core.config import TrainerConfig
from posttrain.core.errors import UsageError
from posttrain.core.model_spec import count_params
from posttrain.core.plugins import load_plugins
from posttrain.plugins.trainers.megatron.convert import verify_checkpoint
from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

from tests.unit.plugins.trainers.megatron.train_helpers import local_loss, spec_for, torchrun, tp_batch, trainer_configs

HERE = Path(__file__).parent
FAMILIES = ("qwen3_moe", "glm4_moe")


@pytest.mark.parametrize("family,preset,total,active", [
    ("qwen3_moe", "qwen3-30B-A3B", 30.5, 3.35), ("qwen3_moe", "qwen3-235B-A22B", 235.1, 22.2),
    ("glm4_moe", "glm4.5-air", 106.9, 13.4), ("glm4_moe", "glm4.5", 352.8, 33.6),
])
def test_moe_presets_have_the_published_sizes(family, preset, total, active):
    """Published: 30.5B/3.3B, 235B/22B; GLM-4.5-Air 106B/12B and GLM-4.5 355B/32B count the MTP layer in
    the total and leave the embeddings (1.2B/1.6B) out of the active count."""
    hf = load_plugins().registry("model")[family].presets[preset]
    assert count_params(hf) / 1e9 == pytest.approx(total, abs=0.06)
    assert count_params(hf, active=True) / 1e9 == pytest.approx(active, abs=0.06)


def test_moe_mapping_names_every_expert_and_refuses_what_megatron_routes_differently():
    spec = spec_for("glm4_moe")
    hf = spec.hf_config()
    names = spec.megatron_names(hf)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names  # first_k_dense_replace = 1: layer 0 is dense
    assert "decoder.layers.0.mlp.router.weight" not in names
    assert "decoder.layers.2.mlp.experts.local_experts.7.linear_fc2.weight" in names
    assert "decoder.layers.2.mlp.router.expert_bias" in names and "decoder.layers.2.mlp.shared_experts.linear_fc1.weight" in names
    assert spec.hf_sources(hf, "decoder.layers.2.mlp.experts.local_experts.7.linear_fc1.weight") == [
        "model.layers.2.mlp.experts.7.gate_proj.weight", "model.layers.2.mlp.experts.7.up_proj.weight"]
    assert spec.ignored_hf_tensor(hf, "model.layers.3.eh_proj.weight")  # the MTP layer past num_hidden_layers
    tc = spec.transformer_config(hf)
    assert tc["moe_layer_freq"] == [0, 1, 1] and tc["moe_router_topk_scaling_factor"] == 2.5
    with pytest.raises(UsageError, match="top-2"):  # HF scores a group by 2 experts, Megatron by k/topk_group
        spec.transformer_config({**hf, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 8})
    qwen = spec_for("qwen3_moe")
    assert qwen.transformer_config({**qwen.hf_config(), "norm_topk_prob": False})["moe_router_pre_softmax"]


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_tp1_matches_transformers_and_round_trips(tiny_ckpts, megatron_tp1, family):
    path = tiny_ckpts(family)
    result = verify_checkpoint(spec_for(family, path), path, attention="sdpa")
    assert result["passed"] and result["max_abs_diff"] < 1e-4, result


def _torchrun(*args: str) -> None:
    torchrun("moe_worker.py", *args, timeout=400)


@pytest.mark.slow
def test_verify_tp2_matches_transformers(tiny_ckpts, tmp_path):
    """Experts split over TP (expert TP = TP): logits equal HF's and every expert tensor gathers back exactly."""
    _torchrun(str(tmp_path / "tp.pt"), "tp", str(tiny_ckpts("qwen3_moe")), str(tiny_ckpts("glm4_moe")))
    for family, result in torch.load(tmp_path / "tp.pt").items():
        assert result["passed"] and result["max_abs_diff"] < 1e-4, (family, result)


@pytest.mark.slow
def test_expert_parallel_step_equals_one_process(tiny_ckpts, tmp_path, megatron_tp1):
    """EP=2 over two ranks (which are also DP=2: each takes half the batch; each holds 4 of the 8 experts)
    verifies against HF, and its log-probs, step and exported weights equal one process with everything."""
    path = tiny_ckpts("qwen3_moe")
    _torchrun(str(tmp_path / "ep.pt"), "ep", str(path))
    ep = torch.load(tmp_path / "ep.pt")
    assert ep["verify"]["passed"], ep["verify"]
    assert ep["local_experts"] == 4
    trainer = MegatronTrainer(spec_for("qwen3_moe", path), TrainerConfig(lr=1e-3, micro_batch_size=1,
                                                                         global_batch_size=4))
    batch = tp_batch()
    batch.old_log_probs = trainer.log_probs(batch)[0]
    lp = ep["lp"]  # each rank computed its half; gathered back in sample order
    assert (batch.old_log_probs[:, : lp.shape[1]] - lp[:, : batch.old_log_probs.shape[1]]).abs().max() < 1e-5
    metrics = trainer.train_step(batch, local_loss)
    assert ep["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    assert ep["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    # load metrics are summed over the DP ranks: the same counts as one process
    assert ep["metrics"]["moe_aux_loss"] == pytest.approx(metrics["moe_aux_loss"], rel=1e-5)
    exported = {k: v for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    assert sorted(exported) == sorted(ep["params"])
    assert max((exported[k] - ep["params"][k]).abs().max().item() for k in exported) < 1e-5


@pytest.mark.slow
def test_models_verify_cli_runs_expert_parallel(tiny_ckpts):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "models", "verify", str(tiny_ckpts("glm4_moe")),
                          "--ep", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ep=2" in out.stdout and "PASS" in out.stdout


def test_train_step_reports_load_balance_and_moves_expert_bias_when_asked(tiny_ckpts, megatron_tp1):
    path = tiny_ckpts("glm4_moe")
    trainer = MegatronTrainer(spec_for("glm4_moe", path), **trainer_configs(
        lr=1e-3, micro_batch_size=2, global_batch_size=4, megatron={"moe_router_bias_update_rate": 0.01}))
    bias = trainer.gpt.decoder.layers[1].mlp.router.expert_bias.clone()
    batch = tp_batch()
    batch.old_log_probs = trainer.log_probs(batch)[0]
    metrics = trainer.train_step(batch, local_loss)
    assert set(metrics) >= {"moe_aux_loss", "moe_load_imbalance/layer_1", "moe_load_imbalance/layer_2"}
    assert "moe_load_imbalance/layer_0" not in metrics  # the dense first layer
    assert metrics["moe_load_imbalance/layer_1"] >= 1.0 and metrics["moe_aux_loss"] > 0
    moved = trainer.gpt.decoder.layers[1].mlp.router.expert_bias - bias
    assert torch.allclose(moved.abs(), torch.full_like(moved, 0.01))  # sign(mean - count) * rate, each expert


def test_run_config_checks_moe_keys_before_anything_starts():
    """Replay and EP need a MoE model; MoE trains with tp=1; SGLang must be told to report routing; the
    run's sampling asks the engines for routed experts exactly when the trainer replays."""
    from posttrain.core.config import load_config
    from posttrain.core.errors import ConfigError

    plugins = load_plugins()
    base = {"estimator": "grpo", "rewards": [{"name": "exact_match"}],
            "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 2},
            "trainer": {"global_batch_size": 4, "micro_batch_size": 2}}

    def errors(model, backend, engine=None):
        data = {**base, "model": {"name": model}, "trainer": {**base["trainer"], "backend": {"name": "megatron", **backend}}}
        if engine:
            data["rollout"] = {**base["rollout"], "engine": engine}
        ranks = backend.get("ep", 1) * backend.get("tp", 1)  # EP splits the experts over data-parallel ranks
        if ranks > 1:
            data["resources"] = {"trainer_procs_per_node": ranks}
        try:
            return load_config(None, data=data, plugins=plugins)
        except ConfigError as exc:
            return sorted(e.split(":")[0] for e in exc.errors)

    assert errors("qwen3", {"routing_replay": True, "ep": 2}) == ["trainer.backend.ep", "trainer.backend.routing_replay"]
    assert errors("qwen3_moe", {"tp": 2}) == ["trainer.backend.tp"]
    assert errors("qwen3_moe", {"routing_replay": True}, {"name": "sglang"}) == [
        "rollout.engine.args.enable_return_routed_experts"]
    ok = errors("glm4_moe", {"routing_replay": True, "ep": 2},
                {"name": "sglang", "args": {"enable_return_routed_experts": True}})
    assert ok.trainer.backend.create(plugins).needs_routed_experts
    sampling = ok.rollout.sampling_params(return_routed_experts=True)
    assert sampling.request_fields() == {"return_routed_experts": True}
    assert "return_routed_experts" not in sampling.to_sglang()  # a request field, not a sampling parameter
