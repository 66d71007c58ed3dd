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
from train_helpers import spec_for


def test_moonlight_preset_has_the_published_size():
    """Moonlight-16B-A3B: 16B parameters, 3B activated (embeddings counted in both)."""
    hf = load_plugins().registry("model")["deepseek_v3"].presets["moonlight-16B-A3B"]
    assert count_params(hf) / 1e9 == pytest.approx(15.96, abs=0.02)
    assert count_params(hf, active=True) / 1e9 == pytest.approx(2.91, abs=0.02)


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
    with pytest.raises(UsageError, match="rope scaling 'yarn'"):
        spec.transformer_config({**hf, "rope_scaling": {"type": "yarn", "factor": 40}})
    with pytest.raises(UsageError, match="attention_bias"):
        spec.transformer_config({**hf, "attention_bias": True})


@pytest.mark.parametrize("variant", [{}, {"q_lora_rank": None, "rope_interleave": False, "rms_norm_eps": 1e-5}])
def test_verify_tp1_matches_transformers_and_round_trips(tmp_path, megatron_tp1, variant):
    """fp32 logits of the whole model (dense first layer, group-limited sigmoid routing, shared expert)
    equal HF's; Megatron -> HF gives back every tensor bit for bit (the halved rotary layout is permuted
    both ways)."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "ckpt", "deepseek_v3", **variant)
    result = verify_checkpoint(spec_for("deepseek_v3", path), path, attention="sdpa")
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



def test_seeded_init_draws_every_latent_attention_weight(megatron_tp1):
    """Without a checkpoint every MLA projection is drawn from the seed (none left ``torch.empty``), the
    latent norms start at one, and the same seed gives the same model. (All layers MoE here: seeded init
    needs identical layers.)"""
    from posttrain.plugins.trainers.megatron.model import build_gpt, megatron_params

    spec = spec_for("deepseek_v3")
    hf = {**spec.hf_config(), "first_k_dense_replace": 0}
    a, b = (megatron_params(build_gpt(spec, hf, attention="sdpa", seed=5)) for _ in range(2))
    for name, p in a.items():
        assert torch.equal(p, b[name]), name
    attn = {n: p for n, p in a.items() if ".self_attention." in n}
    assert len(attn) == 4 * 7
    for name, p in attn.items():
        if "layernorm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert 0.015 < float(p.std()) < 0.025 or name.endswith("linear_proj.weight"), (name, float(p.std()))
