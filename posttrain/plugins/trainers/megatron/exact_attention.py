"""Core attention of the megatron trainer in exact mode (``rollout.exact``): ``posttrain.core.exact.attention``,
the function the local engine's prefill and decode call, so each query's sum over keys runs in the same
blocks and order on both sides.

Shapes (Megatron's): ``sbhd``: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``,
causal (key ``j`` visible to query ``i`` iff ``j <= i``: the trainer's mask); ``thd`` (packed): query
``[t, np, hn]``, key/value ``[t, ng, hn]`` -> ``[t, np * hn]``, causal within each ``cu_seqlens`` segment, one
call per sample. Query head ``i`` reads key/value group ``i // (np / ng)``.
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.module import MegatronModule

from posttrain.core import exact


class ExactAttention(MegatronModule):
    """Drop-in for ``DotProductAttention`` in a layer spec's ``core_attention`` slot."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("ExactAttention does not support context parallelism")
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("ExactAttention: attention_bias is not supported")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = getattr(packed_seq_params, "cu_seqlens_host", None) or packed_seq_params.cu_seqlens_q.tolist()
            outs = [self._causal(*(x[a:b].unsqueeze(1) for x in (query, key, value)))[:, 0]
                    for a, b in zip(cu[:-1], cu[1:])]
            out = torch.cat(outs, dim=0)
            return out.reshape(out.shape[0], -1)
        out = self._causal(query, key, value)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _causal(self, query, key, value):
        """``[s, b, heads, hn]`` each -> ``[s, b, np, hn]``: causal ``exact.attention``."""
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        b, _, s, _ = q.shape
        positions = torch.arange(s, device=q.device)[None, :].expand(b, s)
        return exact.attention(q, k, v, positions, self.softmax_scale).permute(2, 0, 1, 3)
