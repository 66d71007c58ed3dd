"""trainer.lora's config and the engines' adapter merging (posttrain.core.lora); push bytes at the 1.7B shape."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.lora import ALL_LINEAR, LORA_A, LORA_B, AdapterMerge


def test_adapter_merge_merges_each_push_from_the_kept_base():
    """W = base + B' @ A at every push (never on top of the previous merge); a pair may span two buckets; a plain
    tensor is a new base."""
    g = torch.Generator().manual_seed(0)
    weights = {"m.weight": torch.randn(6, 5, generator=g)}
    base = weights["m.weight"].clone()
    merge = AdapterMerge()
    for _ in range(2):
        a, b = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
        assert merge.resolve({"m" + LORA_A: a}, weights.__getitem__) == {}  # half a pair waits
        out = merge.resolve({"m" + LORA_B: b}, weights.__getitem__)
        assert torch.allclose(out["m.weight"], base + b @ a, atol=1e-6)
        weights.update(out)
    fresh = torch.zeros(6, 5)
    assert merge.resolve({"m.weight": fresh}, weights.__getitem__)["m.weight"] is fresh
    weights["m.weight"] = fresh
    out = merge.resolve({"m" + LORA_A: a, "m" + LORA_B: b}, weights.__getitem__)
    assert torch.allclose(out["m.weight"], b @ a, atol=1e-6), "the new base, not the old one"
    with pytest.raises(ValueError, match="does not give the weight's shape"):
        merge.resolve({"m" + LORA_A: torch.ones(2, 4), "m" + LORA_B: b}, weights.__getitem__)


def test_lora_config_errors_name_the_key():
    from posttrain.core.config import load_config
    from posttrain.core.errors import ConfigError
    from posttrain.core.plugins import load_plugins
    from posttrain.testing.contracts.trainer import RUN

    data = {**RUN, "trainer": {**RUN["trainer"], "lora": {"rank": -1, "target_modules": ["qproj"]}}}
    with pytest.raises(ConfigError) as caught:
        load_config(None, data=data, plugins=load_plugins(autoload=False))
    assert any(e.startswith("trainer.lora.rank:") for e in caught.value.errors), caught.value.errors
    data["trainer"]["lora"]["rank"] = 8
    with pytest.raises(ConfigError) as caught:
        load_config(None, data=data, plugins=load_plugins(autoload=False))
    assert any(e.startswith("trainer.lora.target_modules: qproj not among") for e in caught.value.errors)


def test_adapter_push_bytes_at_rank_32_on_the_qwen3_1p7b_shape():
    """The adapter-only push (fsdp2's export view over a meta-device Qwen3-1.7B-shaped model with peft adapters of
    rank 32) against the full push (every HF tensor, the tied output layer once): attention adapters (q, k, v, o)
    0.75%, all seven linears 2.03% (peft's layout: q, k, v, gate and up each their own A)."""
    import transformers

    from posttrain.plugins.trainers.fsdp2 import lora

    config = transformers.Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                      vocab_size=151936, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    full = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: the embedding once

    def pushed(targets):
        cfg = type("Lora", (), {"rank": 32, "alpha": 64.0, "dropout": 0.0, "target_modules": targets})
        with torch.device("meta"):
            with_adapters = lora.wrap(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), cfg)
        named = lora.hf_tensors(iter(with_adapters.state_dict().items()), "adapters", 2.0, lambda t: t)
        return sum(t.numel() * 2 for _, t in named)  # bf16 on the wire

    attention = pushed(["q_proj", "k_proj", "v_proj", "o_proj"]) / full
    every = pushed(list(ALL_LINEAR)) / full
    assert full == 2 * 1_720_574_976
    assert round(attention, 4) == 0.0075 and attention <= 0.02
    assert round(every, 4) == 0.0203


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_the_lora_quickstart_validates_on_both_backends(backend):
    from pathlib import Path

    from posttrain.core.config import load_config
    from posttrain.core.plugins import load_plugins

    path = Path(__file__).parents[3] / "examples" / "quickstart-lora.yaml"
    run = load_config(path, [f"trainer.backend.name={backend}"], plugins=load_plugins(autoload=False))
    assert run.trainer.lora.enabled and "lm_head" in run.trainer.lora.target_modules


def test_an_adapter_for_a_weight_the_engine_lacks_is_refused():
    with pytest.raises(ValueError, match="m.weight: a LoRA adapter for a weight this model does not have"):
        AdapterMerge().resolve({"m" + LORA_A: torch.ones(2, 3), "m" + LORA_B: torch.ones(4, 2)}, {}.get)
