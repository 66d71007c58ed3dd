"""Grouped expert GEMMs (:mod:`posttrain.plugins.trainers.megatron.grouped_experts`) against Megatron's
``SequentialMLP`` on the same parameters: outputs and gradients (tokens, routing probs, every expert
weight) equal in fp32, with the grouped kernel and with the per-expert loop, an expert with no tokens
included; and a whole MoE model's logits and gradients equal either way."""

from __future__ import annotations

import pytest
import torch

from posttrain.plugins.trainers.megatron import model as M
from posttrain.plugins.trainers.megatron.grouped_experts import GroupedExperts, gmm, gmm_wgrad
from train_helpers import spec_for


def _experts(model):
    return [layer.mlp.experts for layer in model.decoder.layers if hasattr(layer.mlp, "experts")]


def _run(experts, x, counts, probs, grouped: bool, kernel: bool):
    experts.grouped, experts.kernel = grouped, kernel
    for p in experts.parameters():
        p.grad = None
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y, bias = experts(x, counts, probs)
    assert bias is None
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return [y.detach(), x.grad, probs.grad] + [p.grad.clone() for p in experts.parameters()]


def test_gmm_matches_a_loop_over_experts():
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 4]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x, w = torch.randn(12, 8, generator=g), torch.randn(4, 8, 16, generator=g)
    dy = torch.randn(12, 16, generator=g)
    want = torch.cat([x[s:s + n] @ w[e] for e, (s, n) in enumerate(zip([0, 3, 3, 8], counts))])
    for kernel in (True, False):
        assert torch.allclose(gmm(x, w, offs, counts, kernel), want, atol=1e-5)
        dw = gmm_wgrad(x.t(), dy, offs, counts, kernel)  # [4, 8, 16]
        assert torch.allclose(dw[2], x[3:8].t() @ dy[3:8], atol=1e-5)
        assert torch.equal(dw[1], torch.zeros(8, 16))  # the expert with no tokens gets no gradient


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_grouped_experts_equal_sequential_forward_and_gradients(megatron_tp1, family):
    spec = spec_for(family)
    model = M.build_gpt(spec, spec.hf_config(), seed=3)
    experts = _experts(model)[0]
    assert isinstance(experts, GroupedExperts) and experts.grouped  # the MoE specs' default
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 0, 3, 9, 1, 0, 6, 4])  # sorted by local expert, two experts idle
    x = torch.randn(int(counts.sum()), spec.hf_config()["hidden_size"], generator=g)
    probs = torch.rand(x.shape[0], generator=g)
    sequential = _run(experts, x, counts, probs, grouped=False, kernel=False)
    for kernel in (True, False):
        grouped = _run(experts, x, counts, probs, grouped=True, kernel=kernel)
        assert len(grouped) == len(sequential) == 3 + 2 * 8
        for i, (a, b) in enumerate(zip(grouped, sequential)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (kernel, i, (a - b).abs().max())
    idle = [p.grad for e in (1, 5) for p in experts.local_experts[e].parameters()]
    assert all(torch.equal(gr, torch.zeros_like(gr)) for gr in idle)


def test_moe_model_logits_and_gradients_equal_with_either_experts(megatron_tp1):
    """The whole tiny GLM-4.5 (dense layer, shared experts, sigmoid router with bias) through Megatron's
    all-to-all dispatcher: grouped and sequential experts give the same logits and parameter gradients."""
    spec = spec_for("glm4_moe")
    hf = spec.hf_config()
    tokens = torch.randint(0, hf["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24).expand(2, -1)
    outs = []
    for grouped in (True, False):
        model = M.build_gpt(spec, hf, seed=7, transformer_overrides={"moe_grouped_gemm": grouped})
        assert all(e.grouped == grouped for e in _experts(model))
        logits = model(tokens, positions, None)
        (logits.float().log_softmax(-1)[..., 0].sum()).backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (la, ga), (lb, gb) = outs
    assert torch.allclose(la, lb, rtol=1e-5, atol=1e-5)
    assert sorted(ga) == sorted(gb) and any(".local_experts." in n for n in ga)
    assert [n for n in ga if not torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-5)] == []
