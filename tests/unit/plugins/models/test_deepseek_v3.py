"""The ``deepseek_v3`` spec (multi-head latent attention, DeepSeekMoE routing) on Megatron: preset sizes,
the mapping's names, HF <-> Megatron conversion against ``transformers`` in fp32 (interleaved and halved
rotary layouts, with and without a q low-rank), multi-token-prediction tensors skipped on load, and
TP=2 / EP=2 / PP=2 under ``torchrun``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from posttrain.core.errors import UsageError
from posttrain.core.model_spec import count_params
from posttrain.core.plugins import load_plugins
from posttrain.plugins.trainers.megatron.convert import verify_checkpoint
from tests.unit.plugins.trainers.megatron.train_helpers import spec_for


@pytest.mark.parametrize("preset,total,active", [("moonlight-16B-A3B", 15.96, 2.91), ("deepseek-v3", 671.0, 37.55),
                                                 ("kimi-k2", 1026.4, 32.86)])
def test_presets_have_the_published_sizes(preset, total, active):
    """Published: Moonlight 16B / 3B activated, DeepSeek-V3 671B / 37B, Kimi-K2 1.04T / 32B (without the MTP
    layers; embeddings counted in both)."""
    cls = load_plugins().registry("model")["deepseek_v3"]
    hf = cls.presets[preset]
    assert count_params(hf) / 1e9 == pytest.approx(total, abs=0.06)
    assert count_params(hf, active=True) / 1e9 == pytest.approx(active, abs=0.06)
    spec = cls(cls.Config(preset=preset))
    assert spec.transformer_config(spec.hf_config())["rope_type"] == ("rope" if preset.startswith("moon") else "yarn")


def test_mapping_names_latent_attention_and_routing_fields():
    spec = spec_for("deepseek_v3")
    hf = spec.hf_config()
    names = spec.megatron_names(hf)
    assert "decoder.layers.0.self_attention.linear_q_up_proj.weight" in names
    assert "decoder.layers.0.self_attention.linear_qkv.weight" not in names
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names  # first_k_dense_replace = 1
    assert "decoder.layers.1.mlp.router.expert_bias" in names
    assert spec.hf_sources(hf, "decoder.layers.2.self_attention.linear_kv_down_proj.weight") == [
        "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"]
    no_q_rank = spec.megatron_names({**hf, "q_lora_rank": None})
    assert "decoder.layers.0.self_attention.linear_q_proj.weight" in no_q_rank
    assert not any("q_down_proj" in n or "q_layernorm" in n for n in no_q_rank)
    tc = spec.transformer_config(hf)
    assert tc["multi_latent_attention"] and tc["q_lora_rank"] == 32 and tc["qk_pos_emb_head_dim"] == 8
    assert tc["moe_router_num_groups"] == 2 and tc["moe_router_group_topk"] == 1
    assert tc["moe_router_score_function"] == "sigmoid" and tc["moe_router_topk_scaling_factor"] == 2.5
    assert spec.ignored_hf_tensor(hf, "model.layers.4.eh_proj.weight")  # an MTP layer
    with pytest.raises(UsageError, match="rope scaling 'dynamic'"):
        spec.transformer_config({**hf, "rope_scaling": {"type": "dynamic", "factor": 4}})
    with pytest.raises(UsageError, match="only one of mscale"):
        spec.transformer_config({**hf, "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0}})
    with pytest.raises(UsageError, match="attention_bias"):
        spec.transformer_config({**hf, "attention_bias": True})


YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4, "beta_fast": 1, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 50000.0}  # Kimi-K2's, at a tiny original context


@pytest.mark.parametrize("variant", [{}, {"q_lora_rank": None, "rope_interleave": False, "rms_norm_eps": 1e-5},
                                     {"rope_parameters": YARN}])
def test_verify_tp1_matches_transformers_and_round_trips(tmp_path, megatron_tp1, variant):
    """fp32 logits of the whole model (dense first layer, group-limited sigmoid routing, shared expert)
    equal HF's over 32 positions; Megatron -> HF gives back every tensor bit for bit (the halved rotary
    layout is permuted both ways); YaRN as HF scales it (without it the logits differ by ~2e-3)."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "ckpt", "deepseek_v3", **variant)
    result = verify_checkpoint(spec_for("deepseek_v3", path), path, attention="sdpa", seq_len=32)
    assert result["passed"] and result["max_abs_diff"] < 1e-5, result


def test_multi_token_prediction_layers_are_skipped_with_one_line(tmp_path, megatron_tp1, capsys):
    from safetensors.torch import load_file, save_file

    from posttrain.testing.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "ckpt", "deepseek_v3")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.4.enorm.weight"] = torch.ones(64)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    result = verify_checkpoint(spec_for("deepseek_v3", path), path, attention="sdpa")
    assert result["passed"], result
    lines = [line for line in capsys.readouterr().out.splitlines() if "skipping" in line]
    assert len(lines) == 1 and "2 checkpoint tensors" in lines[0] and "multi-token prediction" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "ep", "pp"])
def test_models_verify_cli_passes_split_two_ways(tiny_ckpts, mode):
    """``rl-cli models verify --tp 2 | --ep 2 | --pp 2``: logits equal HF's, the way back exact."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "models", "verify",
                          str(tiny_ckpts("deepseek_v3")), f"--{mode}", "2", "--attention", "sdpa"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{mode}=2" in out.stdout and "PASS" in out.stdout and "exact" in out.stdout, out.stdout



def test_seeded_init_draws_every_weight_from_the_seed(megatron_tp1):
    """Without a checkpoint every weight (MLA projections, a dense first layer, routers, experts) is drawn
    from the seed, none left ``torch.empty``; latent norms start at one. (Megatron's own CPU init also
    draws a GQA-shaped output projection that MLA then replaces, so it is not the reference here.)"""
    from posttrain.plugins.trainers.megatron import model as M

    spec = spec_for("deepseek_v3")
    hf = spec.hf_config()
    a, b, c = (M.megatron_params(M.build_gpt(spec, hf, attention="sdpa", seed=s)) for s in (5, 5, 6))
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    for name, p in a.items():
        if "layernorm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        elif not name.endswith("expert_bias"):
            assert not torch.equal(p, c[name]) and 0.005 < float(p.std()) < 0.025, (name, float(p.std()))


def _routed_checkpoint(src, out, router_noise: float):
    """``src`` with experts that matter (down projections x10) and, with ``router_noise``, every router moved
    by that much Gaussian noise (the dense first layer has neither)."""
    from transformers import AutoModelForCausalLM

    from posttrain.testing.tiny import make_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.experts.down_proj.mul_(10.0)
                layer.mlp.gate.weight.add_(router_noise * torch.randn(layer.mlp.gate.weight.shape, generator=g))
    model.save_pretrained(str(out))
    make_tokenizer(out)
    return out


def test_routing_replay_gives_the_trainer_the_engines_experts(tiny_ckpts, tmp_path, megatron_tp1):
    """The local engine's MLA samples carry its routing; a trainer on the same weights reproduces its
    log-probs, and one whose routers moved is brought back towards them by replaying that routing."""
    from dataclasses import replace

    from posttrain.core import batching
    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer
    from tests.unit.plugins.trainers.megatron.test_routing_replay import _gap, _rollouts
    from tests.unit.plugins.trainers.megatron.train_helpers import trainer_configs

    engine_dir = _routed_checkpoint(tiny_ckpts("deepseek_v3"), tmp_path / "engine", 0.0)
    samples = _rollouts(engine_dir)
    for s in samples:  # 4 layers x 2 experts per token; the dense first layer routes nothing
        assert s.rollout_routed_experts.shape == (len(s.tokens) - 1, 4 * 2)
        assert (s.rollout_routed_experts[:, :2] == -1).all() and (s.rollout_routed_experts[:, 2:] >= 0).all()
    batch, _, _, rollout = batching.to_batch(samples)
    mask = batch.response_mask
    cfg = trainer_configs(micro_batch_size=4, global_batch_size=8, routing_replay=True)
    assert _gap(MegatronTrainer(spec_for("deepseek_v3", engine_dir), **cfg).log_probs(batch)[0], rollout, mask) < 1e-5
    moved = MegatronTrainer(spec_for("deepseek_v3", _routed_checkpoint(tiny_ckpts("deepseek_v3"), tmp_path / "moved",
                                                                       0.05)), **cfg)
    gap_replay = _gap(moved.log_probs(batch)[0], rollout, mask)
    gap_own = _gap(moved.log_probs(replace(batch, routed_experts=None))[0], rollout, mask)
    assert gap_own > 0.01 and gap_replay < 0.5 * gap_own, (gap_replay, gap_own)
