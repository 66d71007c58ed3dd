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


def test_moe_sums_experts_in_id_order_whatever_the_batch(g):
    x, router = torch.randn(20, 8, generator=g), torch.randn(6, 8, generator=g)
    w1, w2 = torch.randn(6, 10, 8, generator=g), torch.randn(6, 8, 5, generator=g)
    logits = exact.linear(x, router)
    ids = exact.softmax(logits).topk(2, -1).indices
    chosen = torch.zeros(20, 6, dtype=torch.bool).scatter_(1, ids, True)
    expert = lambda e, rows: exact.swiglu_expert(rows, w1[e], w2[e])  # noqa: E731
    y = exact.moe(x, logits, chosen, expert, True)
    assert torch.equal(exact.moe(x[4:9], logits[4:9], chosen[4:9], expert, True), y[4:9])
    p = torch.softmax(logits, -1).gather(1, ids)
    p = p / p.sum(-1, keepdim=True)
    want = sum(p[:, j:j + 1] * torch.stack([expert(int(e), x[i:i + 1])[0] for i, e in enumerate(ids[:, j])])
               for j in range(2))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


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
