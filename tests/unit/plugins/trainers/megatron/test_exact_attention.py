"""Exact mode's core attention for Megatron: SDPA's values to float rounding, and a sample's output the same bits
padded in a batch, packed beside others (THD) or alone, as the engine's exact attention gives."""

from __future__ import annotations

import pytest
import torch

from posttrain.core import exact

pytestmark = pytest.mark.usefixtures("megatron_tp1")


def _attention():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from posttrain.plugins.trainers.megatron.exact_attention import ExactAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               kv_channels=8, hidden_dropout=0.0, attention_dropout=0.0,
                               masked_softmax_fusion=False, use_cpu_initialization=True)
    return ExactAttention(config, 1, AttnMaskType.causal, "self")


def test_padded_packed_and_alone_give_the_same_bits():
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = _attention()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(20, 2, 4, 8, generator=g), torch.randn(20, 2, 2, 8, generator=g), torch.randn(20, 2, 2, 8, generator=g)
    padded = attn(q, k, v, None)  # [20, 2, 32]: two rows of 20 positions
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True,
                                                            scale=8 ** -0.5, enable_gqa=True)
    torch.testing.assert_close(padded, sdpa.permute(2, 0, 1, 3).reshape(20, 2, 32), rtol=1e-5, atol=1e-5)
    alone = attn(q[:13, 1:], k[:13, 1:], v[:13, 1:], None)  # row 1's first 13 positions, unpadded
    assert torch.equal(alone[:, 0], padded[:13, 1])
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)  # row 0's first 7 positions, then row 1's 13, packed
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=13, max_seqlen_kv=13)
    packed = attn(*(torch.cat([x[:7, 0], x[:13, 1]]) for x in (q, k, v)), None, packed_seq_params=psp)
    assert torch.equal(packed[:7], padded[:7, 0]) and torch.equal(packed[7:], padded[:13, 1])
    # the engine's decode of position 12 over a longer cache span: the same bits
    cache_k, cache_v = torch.zeros(1, 2, 48, 8), torch.zeros(1, 2, 48, 8)
    cache_k[0, :, :13], cache_v[0, :, :13] = k[:13, 1].transpose(0, 1), v[:13, 1].transpose(0, 1)
    step = exact.attention(q[12:13, 1].transpose(0, 1)[None], cache_k, cache_v, torch.tensor([[12]]), 8 ** -0.5)
    assert torch.equal(step[0, :, 0].reshape(-1), padded[12, 1])
