"""posttrain.core.exact: each result is the same float whatever else is in the batch (rows, columns, keys,
vocabulary padding), while staying the usual math to float rounding."""

import pytest
import torch
import torch.nn.functional as F

from posttrain.core import exact


@pytest.fixture
def g():
    return torch.Generator().manual_seed(0)


def test_plain_torch_is_not_batch_invariant_which_is_why_this_module_exists(g):
    a, b = torch.randn(300, 256, generator=g), torch.randn(256, 200, generator=g)
    assert not torch.equal(a[5:6] @ b, (a @ b)[5:6])  # a one-row product takes another kernel (gemv)


@pytest.mark.parametrize("k", [1, 16, 64, 250])
def test_bmm_rows_do_not_depend_on_the_other_rows_or_columns(g, k):
    a, b = torch.randn(2, 300, k, generator=g), torch.randn(2, k, 200, generator=g)
    full = exact.bmm(a, b)
    torch.testing.assert_close(full, a @ b, rtol=1e-5, atol=1e-4)
    for m in (1, 3, 17, 129):
        rows, cols = torch.randperm(300, generator=g)[:m], torch.randperm(200, generator=g)[:37]
        assert torch.equal(exact.bmm(a[:, rows], b[:, :, cols]), full[:, rows][:, :, cols])
    assert torch.equal(exact.mm(a[1, 7:8], b[1]), full[1, 7:8])


def test_row_sum_is_blind_to_trailing_zeros(g):
    x = torch.randn(5, 300, generator=g)
    padded = torch.cat([x, torch.zeros(5, 211)], -1)
    assert torch.equal(exact.row_sum(x), exact.row_sum(padded))
    assert torch.equal(exact.row_sum(x)[2:3], exact.row_sum(x[2:3]))
    torch.testing.assert_close(exact.row_sum(x)[:, 0], x.sum(-1), rtol=1e-5, atol=1e-5)


def test_log_softmax_ignores_a_padded_vocabulary_and_the_batch(g):
    z = torch.randn(6, 300, generator=g) * 4
    lp = exact.log_softmax(z)
    torch.testing.assert_close(lp, z.log_softmax(-1), rtol=0, atol=2e-6)
    assert torch.equal(exact.log_softmax(torch.cat([z, torch.full((6, 84), -1e30)], -1))[:, :300], lp)
    assert torch.equal(exact.log_softmax(z[4:5]), lp[4:5])


def test_silu_is_the_same_at_every_position_unlike_torch_silu(g):
    x = torch.randn(1 << 16, generator=g) * 5
    strided = torch.stack([x, x], 1)[:, 0]  # another loop (scalar tail) inside torch's kernels
    assert torch.equal(exact.silu(x), exact.silu(strided))
    torch.testing.assert_close(exact.silu(x), F.silu(x), rtol=1e-6, atol=1e-6)


def test_rms_norm_per_row(g):
    x, w = torch.randn(40, 96, generator=g), torch.randn(96, generator=g)
    y = exact.rms_norm(x, w, 1e-6)
    assert torch.equal(y[3:4], exact.rms_norm(x[3:4], w, 1e-6))
    torch.testing.assert_close(y, w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_attention_decode_over_any_cache_span_equals_the_causal_pass(g):
    """The engine's decode (one query, a cache span with stale keys past its position) and the trainer's causal
    forward over the whole sequence give the same bits; GQA (4 query heads on 2 KV heads)."""
    b, h, hkv, s, d = 3, 4, 2, 37, 16
    q, k, v = torch.randn(b, h, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    full = exact.attention(q, k, v, torch.arange(s).expand(b, s), 0.25)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    for p in (0, 15, 16, 36):
        cache_k, cache_v = torch.randn(b, hkv, 64, d, generator=g), torch.randn(b, hkv, 64, d, generator=g)
        cache_k[:, :, :p + 1], cache_v[:, :, :p + 1] = k[:, :, :p + 1], v[:, :, :p + 1]
        step = exact.attention(q[:, :, p:p + 1], cache_k, cache_v, torch.full((b, 1), p), 0.25)
        assert torch.equal(step[:, :, 0], full[:, :, p])
        prefix = exact.attention(q[1:2, :, :p + 1], k[1:2, :, :p + 1], v[1:2, :, :p + 1], torch.arange(p + 1)[None], 0.25)
        assert torch.equal(prefix, full[1:2, :, :p + 1])
    narrow = v[..., :10]  # values narrower than the keys (multi-head latent attention: d_v != d_nope + d_rope)
    got = exact.attention(q, k, narrow, torch.arange(s).expand(b, s), 0.25)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, narrow, is_causal=True, scale=0.25,
                                                                   enable_gqa=True), rtol=1e-5, atol=1e-5)


def test_moe_sums_experts_in_id_order_whatever_the_batch(g):
    x, router = torch.randn(20, 8, generator=g), torch.randn(6, 8, generator=g)
    w1, w2 = torch.randn(6, 10, 8, generator=g), torch.randn(6, 8, 5, generator=g)
    routing = exact.Routing(top_k=2)
    logits = exact.router_logits(x, router, routing)
    ids = exact.choose_experts(logits, routing)
    assert torch.equal(ids, exact.softmax(logits).topk(2, -1).indices)
    chosen = exact.chosen_mask(ids, 6)
    expert = lambda e, rows: exact.swiglu_expert(rows, w1[e], w2[e])  # noqa: E731
    y = exact.moe(x, exact.routing_weights(logits, chosen, routing), chosen, expert)
    part = exact.moe(x[4:9], exact.routing_weights(logits[4:9], chosen[4:9], routing), chosen[4:9], expert)
    assert torch.equal(part, y[4:9])
    p = torch.softmax(logits, -1).gather(1, ids)
    p = p / p.sum(-1, keepdim=True)
    want = sum(p[:, j:j + 1] * torch.stack([expert(int(e), x[i:i + 1])[0] for i, e in enumerate(ids[:, j])])
               for j in range(2))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_sigmoid_routing_is_hfs_group_limited_rule_and_weights(g):
    """GLM-4.5 / DeepSeek-V3 routing: choice by sigmoid + bias within the best groups (a group's score: its top-2
    sum), weights the chosen sigmoid scores renormalized times the scaling factor; a shared expert added."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    hf = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, 8, generator=g))
        hf.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.1)
    x = torch.randn(40, 8, generator=g)
    _, hf_w, hf_ids = hf(x)
    routing = exact.Routing(top_k=2, score="sigmoid", scale=2.5, groups=4, group_top_k=2, fp32=True)
    logits = exact.router_logits(x, hf.weight, routing)
    ids = exact.choose_experts(logits, routing, hf.e_score_correction_bias)
    assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
    w = exact.routing_weights(logits, exact.chosen_mask(ids, 8), routing)
    torch.testing.assert_close(w.gather(1, hf_ids), hf_w, rtol=1e-6, atol=1e-6)
    assert torch.equal((w != 0).sum(-1), torch.full((40,), 2))
    assert torch.equal(exact.routing_weights(logits[7:9], exact.chosen_mask(ids[7:9], 8), routing), w[7:9])
    # the sigmoid is elementwise wherever the element sits, unlike torch's on the CPU
    z = torch.randn(1 << 16, generator=g) * 5
    assert torch.equal(exact.sigmoid(z), exact.sigmoid(torch.stack([z, z], 1)[:, 0]))
    shared = lambda rows: rows * 2.0  # noqa: E731
    chosen = exact.chosen_mask(ids, 8)
    y = exact.moe(x, w, chosen, lambda e, rows: rows * float(e), shared)
    torch.testing.assert_close(y, (w * torch.arange(8.0)).sum(-1, keepdim=True) * x + 2.0 * x)


def test_routing_refuses_a_score_function_it_does_not_cover():
    with pytest.raises(ValueError, match="score function 'sqrtsoftplus' is not covered"):
        exact.Routing(top_k=2, score="sqrtsoftplus")


def test_mode_makes_unmodified_linears_batch_invariant_and_refuses_fused_attention(g):
    lin = torch.nn.Linear(300, 70, bias=True)
    x = torch.randn(50, 300, generator=g)
    with exact.mode():
        full, one, three_d = lin(x), lin(x[4:5]), lin(x[None, 2:9])
        with pytest.raises(RuntimeError, match="not batch-invariant"):
            F.scaled_dot_product_attention(x[None, None, :4, :16], x[None, None, :4, :16], x[None, None, :4, :16])
    assert torch.equal(full[4:5], one) and torch.equal(full[2:9], three_d[0])
    torch.testing.assert_close(full, F.linear(x, lin.weight, lin.bias))


def test_patch_norms_finds_torch_and_transformers_rms_norms(g):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    model = torch.nn.Sequential(torch.nn.RMSNorm(32, eps=1e-5), Qwen3RMSNorm(32, eps=1e-6), torch.nn.LayerNorm(32))
    assert exact.patch_norms(model) == 2
    x = torch.randn(4, 32, generator=g)
    assert torch.equal(model[0](x), exact.rms_norm(x, model[0].weight, 1e-5))
    assert torch.equal(model[1](x), exact.rms_norm(x, model[1].weight, 1e-6))
