"""perf/mfu's model FLOPs (core/flops.py) against torch's FLOP counter on the HF model, and the metrics."""

from __future__ import annotations

import pytest


def test_forward_flops_match_torch_flop_counter_on_the_hf_model():
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from posttrain.core.flops import forward_flops
    from posttrain.testing.tiny import tiny_config

    config = tiny_config("qwen3")
    config._attn_implementation = "eager"  # QK^T and AV as matmuls the counter sees
    model = AutoModelForCausalLM.from_config(config).eval()
    hf = config.to_dict()
    s = 12
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, hf["vocab_size"], (1, s)))
    layers, heads, d = hf["num_hidden_layers"], hf["num_attention_heads"], hf["head_dim"]
    # the counter charges full (non-causal) attention, 4 s^2 a d per layer; the model FLOPs count half
    counted = counter.get_total_flops() - 2 * s * s * layers * heads * d
    assert forward_flops(hf, [s]) == pytest.approx(counted, rel=1e-9)


def test_throughput_metrics():
    from posttrain.core.flops import peak_flops, throughput_metrics

    train = {"loss": 1.0, "model_flops": 4e12, "peak_flops": 1e12, "devices": 2.0}
    out = throughput_metrics(train, tokens=1000, step_s=2.0, train_s=1.0, devices=4)
    assert out["perf/tokens_per_s_per_gpu"] == pytest.approx(125.0)
    assert out["perf/mfu"] == pytest.approx(2.0) and out["perf/train_tflops_per_gpu"] == pytest.approx(2.0)
    assert train == {"loss": 1.0}, "the trainer's bookkeeping keys are taken out"
    assert "perf/mfu" not in throughput_metrics({"model_flops": 1.0}, 10, 1.0, 1.0, 1), "no peak: no MFU"
    import torch

    assert peak_flops(torch.device("cpu")) is None and peak_flops(torch.device("cpu"), 2.0) == 2e12
