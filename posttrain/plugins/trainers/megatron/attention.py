"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (GPU without TE, and CPU).

Megatron's local ``DotProductAttention`` materializes the ``[b, np, s, s]`` score matrix (and builds its
default causal mask on ``"cuda"``); SDPA dispatches to flash / memory-efficient kernels instead: on an
H200 the same model ran 1.7x faster (DESIGN.md, Measured anchors). It also takes packed sequences
(``qkv_format="thd"``, one causal segment per ``cu_seqlens`` entry), which the local module refuses,
so variable-length samples pack into one row without padding.

Shapes: ``sbhd``: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``;
``thd``: query ``[t, np, hn]``, key/value ``[t, ng, hn]`` -> ``[t, np * hn]``. Query head ``i`` reads
key/value group ``i // (np / ng)`` (Megatron's GQA layout, which ``enable_gqa`` follows).
``attention_mask`` (bool, True = masked, ``[b, 1, sq, sk]``) is honoured when given; otherwise causal.
K/V heads are repeated to the query heads; ``POSTTRAIN_SDPA_GQA=1`` passes ``enable_gqa=True`` instead.
Packed sequences on a GPU (bf16/fp16) go to ``torch.nn.attention.varlen.varlen_attn`` (flash attention
over ``cu_seqlens``, GQA native): one kernel per layer, no per-sample loop, traceable by
``torch.compile``. Elsewhere (CPU, fp32, older torch) each sample is one SDPA call; that loop reads its
offsets from ``packed_seq_params.cu_seqlens_host`` (a Python list the trainer attaches: no device sync
per layer) and is never traced (traced, it would specialize on the offsets and recompile for every new
set of lengths).
"""

from __future__ import annotations

import inspect
import math
import os

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

try:
    from torch.nn.attention.varlen import varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # torch without it: the per-sample loop
    varlen_attn, _VARLEN_PARAMS = None, set()


class SDPAttention(MegatronModule):
    """Drop-in for ``DotProductAttention`` in a layer spec's ``core_attention`` slot."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism; use TE's attention")
        head_dim = k_channels or config.kv_channels  # MLA: q/k heads of d_nope + d_rope, v heads of d_v
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # Opt-in (a GPU lever to measure): let SDPA read the shared k/v heads instead of repeating them.
        self.native_gqa = os.environ.get("POSTTRAIN_SDPA_GQA", "0") == "1"

    def _sdpa(self, q, k, v, mask):
        # q [b, np, s, hn], k/v [b, ng, s, hn]
        p = self.dropout if self.training else 0.0
        if k.shape[1] != q.shape[1] and self.native_gqa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else ~mask, dropout_p=p,
                                                  is_causal=mask is None, scale=self.softmax_scale, enable_gqa=True)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=self.softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, dropout_p=p, scale=self.softmax_scale)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if self._varlen_ok(query, value):
                return self._varlen(query, key, value, packed_seq_params)
            return self._per_sample(query, key, value, packed_seq_params)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        out = self._sdpa(q, k, v, attention_mask)  # [b, np, sq, hn]
        out = out.permute(2, 0, 1, 3)
        return out.reshape(out.shape[0], out.shape[1], -1).contiguous()

    def _varlen_ok(self, query, value=None) -> bool:
        return (varlen_attn is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
                and (self.dropout == 0.0 or not self.training)
                and (value is None or value.shape[-1] == query.shape[-1]))  # MLA's narrower v: per-sample loop

    def _varlen(self, query, key, value, psp):
        """``[t, np, hn]`` packed -> ``[t, np * hn]``, causal within each ``cu_seqlens`` segment."""
        kwargs = {"scale": self.softmax_scale}
        if "window_size" in _VARLEN_PARAMS:
            kwargs["window_size"] = (-1, 0)  # causal
        else:
            kwargs["is_causal"] = True
        if key.shape[1] != query.shape[1]:
            if "enable_gqa" in _VARLEN_PARAMS:
                kwargs["enable_gqa"] = True
            else:
                rep = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        out = varlen_attn(query, key, value, psp.cu_seqlens_q, psp.cu_seqlens_kv, int(psp.max_seqlen_q),
                          int(psp.max_seqlen_kv), **kwargs)
        return out.reshape(out.shape[0], -1)

    @torch.compiler.disable
    def _per_sample(self, query, key, value, psp):
        cu = getattr(psp, "cu_seqlens_host", None) or psp.cu_seqlens_q.tolist()
        outs = []
        for start, end in zip(cu[:-1], cu[1:]):
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            outs.append(self._sdpa(q, k, v, None)[0].transpose(0, 1))  # [s_i, np, hn]
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)
