"""LoRA on the megatron trainer: TP=2 equals TP=1 (log-probs, two steps, merged export, pushed adapters), only
adapters train, the pushed pairs merge in the local engine to the exported weights, resume is exact."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.lora import LORA_A, LORA_B

from tests.unit.plugins.trainers.megatron.train_helpers import torchrun


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from posttrain.testing.tiny import make_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("megatron-lora")
    hf = make_tiny_checkpoint(tmp / "hf", "qwen3")
    out = {}
    for tp in (1, 2):
        torchrun("lora_worker.py", str(hf), str(tmp / f"tp{tp}.pt"), str(tmp / f"ckpt{tp}"), timeout=300, nproc=tp)
        out[tp] = torch.load(tmp / f"tp{tp}.pt", weights_only=False)
        out[tp]["hf_final"] = tmp / f"ckpt{tp}-hf"
    out["hf"] = hf
    return out


@pytest.mark.slow
def test_tp2_equals_tp1(runs):
    one, two = runs[1], runs[2]
    assert (one["lp"] - two["lp"]).abs().max() < 1e-5 and (one["ent"] - two["ent"]).abs().max() < 1e-5
    for a, b in zip(one["metrics"], two["metrics"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert (one["lp2"] - two["lp2"]).abs().max() < 1e-5
    assert (one["lp2"] - one["lp"]).abs().max() > 1e-3, "the adapters moved the policy"
    assert one["merged"].keys() == two["merged"].keys()
    assert max(float((one["merged"][k] - two["merged"][k]).abs().max()) for k in one["merged"]) < 1e-5
    pairs1, pairs2 = dict(one["pairs"]), dict(two["pairs"])
    assert pairs1.keys() == pairs2.keys() and all(torch.allclose(pairs1[k], pairs2[k], atol=1e-6) for k in pairs1)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_only_adapters_train_and_resume_is_exact(runs, tp):
    run = runs[tp]
    assert run["grads"] and all(".lora_" in n for n in run["grads"])
    assert run["optimizer_states"] == run["trainable"] == len(run["grads"])
    assert run["resumed"] == run["third"] and run["resumed_same"]


@pytest.mark.slow
def test_pushed_adapters_merge_to_the_exported_weights(runs):
    """Base + pairs, then pairs alone, into a local engine built from config.json: it then holds export_hf's merged
    weights; the pairs are the adapters alone (q/k/v and gate/up split from the fused linears, A shared)."""
    from posttrain.plugins.engines.local.model_runner import ModelRunner

    run = runs[2]
    names = [n for n, _ in run["pairs"]]
    assert all(n.endswith((LORA_A, LORA_B)) for n in names)
    assert {"model.layers.0.self_attn.k_proj" + LORA_B, "model.layers.0.mlp.up_proj" + LORA_B, "lm_head" + LORA_A} <= set(names)
    engine = ModelRunner(runs["hf"], max_slots=2, context_length=32, from_config=True)
    engine.load_weights(dict(run["base"]))
    engine.load_weights(dict(run["pairs"]))
    held = engine.named_weights()
    assert all(torch.allclose(held[k], v, atol=1e-6) for k, v in run["merged"].items())


@pytest.mark.slow
def test_hf_final_is_the_merged_model_and_a_peft_adapter(runs):
    """TP=2's hf-final: transformers loads the merged model, peft the adapter onto the starting checkpoint; both
    give the same logits, which the adapters moved."""
    import peft
    import transformers

    out, tokens = runs[2]["hf_final"], torch.tensor([[5, 17, 3, 9, 44, 2]])
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(runs["hf"], dtype=torch.float32)
    with torch.no_grad():
        plain = base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, out / "adapter")
        a, b = merged(tokens).logits, adapted(tokens).logits
    assert torch.allclose(a, b, atol=1e-5) and (a - plain).abs().max() > 1e-4
