"""The engine's MoE decode kernels (``moe_kernel``): the fused softmax top-k routing against Qwen3-MoE's
router, the expert-block alignment, and the two grouped expert kernels against transformers' experts, on
CPU tensors under the Triton interpreter; on CUDA in bf16 against transformers' own experts."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from posttrain.plugins.engines.local import moe_kernel

from tests.conftest import run_triton_interpreted

INTERPRETED = r"""
import torch
from transformers import Glm4MoeConfig, Qwen3MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from posttrain.plugins.engines.local import moe_kernel
from posttrain.plugins.engines.local.layers import mlp_forward

torch.manual_seed(0)
# the alignment: every pair once, each block's rows all of its expert, padding rows marked S
ids = torch.tensor([[3, 0], [3, 5], [0, 3], [5, 2], [3, 1]])
rows, blocks = moe_kernel.align(ids, 6, bm=4)
flat = ids.reshape(-1)
assert sorted(rows[rows < 10].tolist()) == list(range(10)) and rows.numel() % 4 == 0
for b, e in enumerate(blocks.tolist()):
    mine = rows[4 * b:4 * b + 4]
    mine = mine[mine < 10]
    assert (e == 6) == (mine.numel() == 0) and all(flat[p] == e for p in mine.tolist())
assert [int(e) for e in blocks if e < 6] == [0, 1, 2, 3, 5]  # expert 4 has no pair, 3 fits one block of 4
# the one-launch alignment: the same blocks, each expert's blocks holding the same pairs (in any order)
for ids_k, e_k, bm in ((ids, 6, 4), (torch.randint(0, 128, (37, 8)), 128, 16), (torch.randint(0, 6, (300, 4)), 6, 64)):
    want_rows, want_blocks = moe_kernel.align(ids_k, e_k, bm)
    got_rows, got_blocks = moe_kernel.align_kernel(ids_k, e_k, bm)
    assert torch.equal(got_blocks, want_blocks)
    for e in range(e_k + 1):
        mine = [r.view(-1, bm)[want_blocks.long() == e].flatten().sort().values for r in (got_rows, want_rows)]
        assert torch.equal(*mine), e

for experts, k, t, norm in ((8, 2, 5, True), (6, 4, 19, False), (8, 8, 1, True)):
    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=experts, num_experts_per_tok=k,
                         norm_topk_prob=norm)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(t, 64)
    with torch.no_grad():
        logits, w_ref, ids_ref = block.gate(x)
        w, ids = moe_kernel.route_topk(logits, k, norm)
        assert torch.equal(ids, ids_ref), (ids, ids_ref)
        torch.testing.assert_close(w, w_ref.float(), atol=1e-6, rtol=1e-5)
        y = moe_kernel.fused_experts(x, ids, w, block.experts.gate_up_proj, block.experts.down_proj)
        torch.testing.assert_close(y, block.experts(x, ids_ref, w_ref), atol=1e-5, rtol=1e-5)
        # a tagged block through the engine's layer function: the same output and routing as untagged
        assert moe_kernel.set_moe_kernel(block, True) == 1
        tagged, routed = mlp_forward(block, x.view(1, t, 64))
        moe_kernel.set_moe_kernel(block, False)
        plain, routed_plain = mlp_forward(block, x.view(1, t, 64))
        torch.testing.assert_close(tagged, plain, atol=1e-5, rtol=1e-5)
        assert torch.equal(routed, routed_plain)

# GLM-4.5: its own sigmoid router (with the bias), the kernels for the experts, shared experts added after
cfg = Glm4MoeConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                    n_shared_experts=1, routed_scaling_factor=2.5, n_group=1, topk_group=1, intermediate_size=128)
block = Glm4MoeMoE(cfg).eval()
for p in block.parameters():
    p.data.normal_(0, 0.1)
block.gate.e_score_correction_bias.normal_(0, 0.1)
x = torch.randn(1, 7, 64)
with torch.no_grad():
    plain, ids_plain = mlp_forward(block, x)
    _, w_ref, _ = block.gate(x.view(7, 64))
    w, ids = moe_kernel.route(block.gate, x.view(7, 64))  # the fused sigmoid routing (one group)
    assert moe_kernel.set_moe_kernel(block, True) == 1
    tagged, ids_tagged = mlp_forward(block, x)
torch.testing.assert_close(tagged, plain, atol=1e-5, rtol=1e-5)
# HF's top-k is unsorted: the same experts per token, each with the same weight
assert torch.equal(ids_tagged.sort(1).values, ids_plain.sort(1).values)
order, order_ref = ids.argsort(1), ids_plain.argsort(1)
torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), atol=1e-6, rtol=1e-5)
print("ok")
"""


RUNNER_INTERPRETED = r"""
import sys, tempfile
import torch
from transformers import AutoModelForCausalLM
from posttrain.plugins.engines.local.model_runner import ModelRunner
from posttrain.plugins.engines.local.moe_kernel import set_moe_kernel
from posttrain.testing.tiny import make_tiny_checkpoint

torch.set_num_threads(1)
for family in ("qwen3_moe", "glm4_moe"):
    path = make_tiny_checkpoint(tempfile.mkdtemp() + "/" + family, family=family, seed=3)
    r = ModelRunner(path, max_slots=2, context_length=32)
    assert set_moe_kernel(r.model, True) >= 2
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    seq = [5, 6, 7, 8]
    logits = r.prefill([0], [seq])
    for _ in range(2):
        seq.append(int(logits[0].argmax()))
        logits = r.decode(torch.tensor([seq[-1]]), torch.tensor([len(seq) - 1]))
        with torch.no_grad():
            torch.testing.assert_close(logits[0], hf(torch.tensor([seq])).logits[0, -1], atol=1e-4, rtol=1e-4)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_engine_decode_with_the_moe_kernels_matches_transformers_under_the_interpreter():
    """The local engine's model runner with its MoE blocks tagged: prefill then decode steps give
    transformers' logits (Qwen3-MoE with the fused routing, GLM-4.5 with its own router and shared experts)."""
    run_triton_interpreted(RUNNER_INTERPRETED)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_moe_kernels_under_the_triton_interpreter():
    run_triton_interpreted(INTERPRETED)


def test_untagged_or_kernel_less_blocks_run_their_own_modules():
    """Without the tag, or on a device the kernels do not run on (fp32 CPU tensors, no interpreter), the
    block's own router and experts run: ``moe_forward`` equals them."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8,
                                                  num_experts_per_tok=2)).eval()
    for p in block.parameters():
        p.data.normal_(0, 0.1)
    assert moe_kernel.applies(block.experts)
    x = torch.randn(6, 64)
    with torch.no_grad():
        y, ids = moe_kernel.moe_forward(block, x)
        _, w_ref, ids_ref = block.gate(x)
        assert torch.equal(ids, ids_ref) and torch.equal(y, block.experts(x, ids_ref, w_ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 37, 256])
def test_moe_kernels_match_transformers_in_bf16_on_cuda(tokens):
    """Qwen3-30B-A3B's MoE block (128 experts of width 768, top-8, hidden 2048) at decode batch sizes."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if not moe_kernel.kernel_available(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("triton did not import")
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True)  # Qwen3-30B-A3B's (the config class defaults to False)
    block = Qwen3MoeSparseMoeBlock(cfg).cuda().to(torch.bfloat16).eval()
    for p in block.parameters():
        p.data.normal_(0, 0.02)
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        logits, w_ref, ids_ref = block.gate(x)
        w, ids = moe_kernel.route_topk(logits, 8, bool(block.gate.norm_topk_prob))
        # the same experts with the same weights; the order within a token's top-8 may differ
        order, order_ref = ids.sort(-1), ids_ref.sort(-1)
        same = (order.values == order_ref.values).all(-1)
        assert same.float().mean() > 0.99  # ties between bf16 logits may pick apart
        w_sorted, w_ref_sorted = w.gather(-1, order.indices), w_ref.to(w.dtype).gather(-1, order_ref.indices)
        assert torch.allclose(w_sorted[same].float(), w_ref_sorted[same].float(), rtol=1e-2, atol=1e-3)
        y = moe_kernel.fused_experts(x, ids_ref, w_ref, block.experts.gate_up_proj, block.experts.down_proj)
        ref = block.experts(x, ids_ref, w_ref)
    assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
