"""Any HF model: tiny random checkpoints of eight architectures no Megatron spec covers each run two quickstart steps
with ``model.name=hf`` (the architecture from config.json), the ``fsdp2`` trainer and the ``hf`` engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMALL = ["rollout.num_rollouts=2", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
         "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "trainer.log_kl=true"]
WIDTH = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=0,
             tie_word_embeddings=False)
# model_type -> config keys on top of WIDTH (what each family needs to be tiny and consistent)
ARCHITECTURES = {
    "gemma3_text": dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16),
    "phi3": {},
    "mistral": dict(head_dim=16, sliding_window=None),
    "olmo2": {},
    "granite": dict(embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.25),
    "starcoder2": dict(use_bias=True),
    "gpt_neox": dict(num_key_value_heads=None, rotary_pct=0.5),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
}


def make_checkpoint(out, model_type: str):
    """A random ``model_type`` model of the tiny width, saved with posttrain's character tokenizer."""
    import torch
    import transformers

    from posttrain.testing.tiny import make_tokenizer

    keys = {k: v for k, v in {**WIDTH, **ARCHITECTURES[model_type]}.items() if v is not None or k == "sliding_window"}
    config = transformers.AutoConfig.for_model(model_type, **keys)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(out))
    make_tokenizer(out)
    return out


def two_steps(tmp_path, ckpt, *overrides: str) -> tuple:
    """``(run dir, metrics rows)`` of two quickstart steps on ``ckpt`` with fsdp2 and the hf engine."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", str(QUICKSTART), "--run-dir", str(run),
                          *SMALL, "model.name=hf", f"model.path={ckpt}", "model.dtype=float32", "model.tokenizer=char",
                          "trainer.backend.name=fsdp2", "rollout.engine.name=hf", *overrides],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return run, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_two_steps_of_any_architecture(tmp_path, model_type):
    """Two steps (weight sync auto: a Gloo group); each step's engine log-probs equal the trainer's (the push
    reached the engine), the reference stays put, and the weight push's bytes are logged."""
    ckpt = make_checkpoint(tmp_path / model_type, model_type)
    run, rows = two_steps(tmp_path, ckpt)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train_rollout_logprob_abs_diff"] < 1e-3, r["train_rollout_logprob_abs_diff"]
    assert rows[0]["train/ref_policy_logprob_abs_diff"] == 0.0 < rows[1]["train/ref_policy_logprob_abs_diff"]
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "model.safetensors"))
    assert all(r["perf/weight_push_bytes"] == sum(t.numel() * t.element_size() for t in weights.values())
               for r in rows), "every step pushes the whole model (float32) once"
    config = json.loads((run / "hf-final" / "config.json").read_text())
    assert config["model_type"] == model_type


@pytest.mark.parametrize("mode", ["disk", "tensor"])
def test_the_other_weight_sync_modes(tmp_path, mode):
    """Pushes from disk and by tensor reach the hf engine exactly: its /weights_checksum matches every pushed
    tensor (rollout.check_weights), and its log-probs equal the trainer's."""
    ckpt = make_checkpoint(tmp_path / "ckpt", "mistral")
    _, rows = two_steps(tmp_path, ckpt, f"rollout.weight_sync={mode}", "rollout.check_weights=true")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-3 and r["perf/weight_push_bytes"] > 0 for r in rows)
