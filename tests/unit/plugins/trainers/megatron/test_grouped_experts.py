"""Grouped expert GEMMs (:mod:`posttrain.plugins.trainers.megatron.grouped_experts`) against Megatron's
``SequentialMLP`` on the same parameters: outputs and gradients (tokens, routing probs, every expert
weight) equal in fp32, with the grouped kernel and with the per-expert loop, an expert with no tokens
included; a whole MoE model's logits and gradients equal either way; the fused SwiGLU kernels equal
their torch formulas."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from posttrain.plugins.trainers.megatron import model as M
from posttrain.plugins.trainers.megatron.grouped_experts import GroupedExperts, gmm, gmm_wgrad

from tests.conftest import run_triton_interpreted
from tests.unit.plugins.trainers.megatron.train_helpers import spec_for


def _experts(model):
    return [layer.mlp.experts for layer in model.decoder.layers if hasattr(layer.mlp, "experts")]


def _run(experts, x, counts, probs, grouped: bool, kernel: bool):
    experts.grouped, experts.kernel = grouped, kernel
    for p in experts.parameters():
        p.grad = None
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y, bias = experts(x, counts, probs)
    assert bias is None
    (y * torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)).sum().backward()
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
    device = next(experts.parameters()).device
    x = torch.randn(int(counts.sum()), spec.hf_config()["hidden_size"], generator=g).to(device)
    probs = torch.rand(x.shape[0], generator=g).to(device)
    sequential = _run(experts, x, counts, probs, grouped=False, kernel=False)
    for kernel in (True, False):
        grouped = _run(experts, x, counts, probs, grouped=True, kernel=kernel)
        assert len(grouped) == len(sequential) == 3 + 2 * 8
        for i, (a, b) in enumerate(zip(grouped, sequential)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (kernel, i, (a - b).abs().max())
    idle = [p.grad for e in (1, 5) for p in experts.local_experts[e].parameters()]
    assert all(torch.equal(gr, torch.zeros_like(gr)) for gr in idle)


def test_grouped_backward_adds_into_ddp_main_grads_once(megatron_tp1):
    """With Megatron DDP's attributes on the weights (fp32 ``main_grad``, ``grad_added_to_main_grad``) the
    grouped backward accumulates into ``main_grad`` itself and marks it, so DDP's hook does not add again."""
    spec = spec_for("qwen3_moe")
    model = M.build_gpt(spec, spec.hf_config(), seed=3)
    experts = _experts(model)[0]
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 5, 4, 2, 0, 1, 6])
    x = torch.randn(int(counts.sum()), spec.hf_config()["hidden_size"], generator=g)
    probs = torch.rand(x.shape[0], generator=g)
    expected = _run(experts, x, counts, probs, grouped=False, kernel=False)[3:]
    weights = list(experts.parameters())  # _run's order
    for w in weights:
        w.main_grad, w.grad_added_to_main_grad = torch.ones_like(w, dtype=torch.float32), False
    _run(experts, x, counts, probs, grouped=True, kernel=False)
    assert all(w.grad_added_to_main_grad for w in weights)
    assert all(torch.allclose(w.main_grad, 1 + e, rtol=1e-5, atol=1e-5) for w, e in zip(weights, expected))
    for w in weights:
        del w.main_grad, w.grad_added_to_main_grad


def test_moe_model_logits_and_gradients_equal_with_either_experts(megatron_tp1):
    """The whole tiny GLM-4.5 (dense layer, shared experts, sigmoid router with bias) through Megatron's
    all-to-all dispatcher: grouped and sequential experts give the same logits and parameter gradients."""
    spec = spec_for("glm4_moe")
    hf = spec.hf_config()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = torch.randint(0, hf["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(24, device=device).expand(2, -1)
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_experts_bf16_on_the_gpu_match_sequential(megatron_tp1):
    """Qwen3-30B-A3B's experts (128 of width 768, hidden 2048) in bf16 on the GPU: ``torch._grouped_mm``'s
    output and gradients within bf16 rounding (1% of the norm) of ``SequentialMLP``'s on the same weights,
    idle experts' gradients exactly zero."""
    from posttrain.core.plugins import load_plugins

    cls = load_plugins().registry("model")["qwen3_moe"]
    spec = cls(cls.Config(preset="qwen3-30B-A3B", dtype="bfloat16", overrides={"num_hidden_layers": 1}))
    experts = _experts(M.build_gpt(spec, spec.hf_config(), dtype="bfloat16", seed=0))[0]
    g = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.rand(128, generator=g) ** 4, 4096 * 8, replacement=True, generator=g).bincount(
        minlength=128)
    counts[:3] = 0  # idle experts
    x = torch.randn(int(counts.sum()), 2048, generator=g).to("cuda", torch.bfloat16)
    probs = torch.rand(x.shape[0], generator=g).cuda()
    sequential = _run(experts, x, counts, probs, grouped=False, kernel=False)
    grouped = _run(experts, x, counts, probs, grouped=True, kernel=True)
    errors = [_rel(a, b) for a, b in zip(grouped, sequential) if b.abs().sum() > 0]
    assert max(errors) < 1e-2, errors
    idle = [p.grad for e in range(3) for p in experts.local_experts[e].parameters()]
    assert all(torch.equal(gr, torch.zeros_like(gr)) for gr in idle)


SWIGLU_INTERPRETED = r"""
import torch
from posttrain.plugins.trainers.megatron.swiglu import swiglu_backward, swiglu_forward

torch.manual_seed(0)
for n, f in ((13, 24), (4, 32), (0, 8)):  # a ragged last block, full blocks, no rows
    h, probs, da = torch.randn(n, 2 * f), torch.rand(n), torch.randn(n, f)
    a = swiglu_forward(h, probs, triton_ok=True)
    torch.testing.assert_close(a, swiglu_forward(h, probs, triton_ok=False), atol=1e-6, rtol=1e-5)
    for got, want in zip(swiglu_backward(h, probs, da, triton_ok=True), swiglu_backward(h, probs, da, triton_ok=False)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # the torch formulas against autograd of the forward
    hh, pp = h.clone().requires_grad_(), probs.clone().requires_grad_()
    swiglu_forward(hh, pp, triton_ok=False).backward(da)
    _, dh, dp = swiglu_backward(h, probs, da, triton_ok=False)
    torch.testing.assert_close(dh, hh.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dp, pp.grad, atol=1e-6, rtol=1e-5)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_swiglu_kernels_equal_the_torch_formulas_under_the_triton_interpreter():
    """The fused prob-weighted SwiGLU forward and backward (one Triton kernel each on CUDA) equal the torch
    formulas, which equal autograd's gradients of the forward."""
    run_triton_interpreted(SWIGLU_INTERPRETED)
