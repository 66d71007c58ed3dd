"""SDPA core attention: equals Megatron's local attention; packed (THD) equals one sequence at a time."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("megatron_tp1")


def _modules():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from posttrain.plugins.trainers.megatron.attention import SDPAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               kv_channels=8, hidden_dropout=0.0, attention_dropout=0.0,
                               masked_softmax_fusion=False, use_cpu_initialization=True)
    args = (config, 1, AttnMaskType.causal, "self")
    return SDPAttention(*args), DotProductAttention(*args)


@pytest.mark.parametrize("native_gqa", [False, True])
def test_sdpa_equals_local_attention(native_gqa):
    sdpa, local = _modules()
    sdpa.native_gqa = native_gqa
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 2, 4, 8, generator=g)
    k, v = torch.randn(7, 2, 2, 8, generator=g), torch.randn(7, 2, 2, 8, generator=g)
    mask = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)[None, None]
    expected = local(q, k, v, mask)
    assert (sdpa(q, k, v, None) - expected).abs().max() < 1e-5
    assert (sdpa(q, k, v, mask) - expected).abs().max() < 1e-5


def test_packed_sequences_attend_only_within_themselves():
    from megatron.core.packed_seq_params import PackedSeqParams

    sdpa, _ = _modules()
    g = torch.Generator().manual_seed(1)
    lengths = [3, 5]
    q = torch.randn(8, 4, 8, generator=g)
    k, v = torch.randn(8, 2, 8, generator=g), torch.randn(8, 2, 8, generator=g)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                                                   cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5))
    start = 0
    for n in lengths:
        alone = sdpa(q[start:start + n, None], k[start:start + n, None], v[start:start + n, None], None)[:, 0]
        assert (packed[start:start + n] - alone).abs().max() < 1e-6
        start += n
