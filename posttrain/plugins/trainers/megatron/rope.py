"""Rotary embeddings of packed (THD) micro-batches without a host sync or a per-sample Python loop.

Megatron's unfused THD rotary (``rope_utils._apply_rotary_pos_emb_thd``) copies ``cu_seqlens`` to the host
(``.tolist()``) and splits the tokens by those Python lengths. Under ``torch.compile`` (``trainer.backend.
compile``) every new set of lengths then recompiles the layer, until dynamo's limit of 8, after which the
layer runs eagerly: the first train phases of a GRPO run take several times the steady one. Here each
token's position inside its sample comes from ``cu_seqlens`` as tensors (no ``searchsorted``: Inductor of
torch 2.11 could not lower it on a slice), so one graph serves
every set of lengths, and every number of samples (the marks go at all of ``cu_seqlens``, not at a slice of it:
a slice ``cu_seqlens[1:-1]`` is one element long for two samples, a size Dynamo treats apart, so a compiled
layer that first met three or more samples a micro-batch recompiled at the first with two, mid-run)::

    seg[i] = #{b : cu_seqlens[b] <= i} - 1        (a cumulative sum of marks)   i = 0 .. t - 1
    pos[i] = i - cu_seqlens[seg[i]]
    out    = rope_bshd(x[:, None], freqs[pos])[:, 0]      x [t, h, d], freqs [max_s, 1, 1, d]

the same values as Megatron's case 2 (``freqs`` holds positions ``0 .. max_s - 1``, which is what GPTModel
builds from ``max_seqlen``; with one sample per micro-batch its case 1 is the same gather).
:func:`install` puts this in front of ``megatron.core.transformer.attention.apply_rotary_pos_emb``
(the name the attention module calls) for exactly the calls it covers: THD, no fused RoPE kernel, one
context-parallel rank, plain ``[max_s, 1, 1, d]`` frequencies. Every other call goes to Megatron's own.
"""

from __future__ import annotations

import torch

_ORIGINAL = None


def thd_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each of ``total`` packed tokens inside its sample (``[total]`` int64), from
    ``cu_seqlens [B + 1]`` (offsets, starting at 0), on ``cu_seqlens``' device with no host copy."""
    cu = cu_seqlens.to(torch.int64)
    # a mark where each sample begins (and one at ``total``, past the tokens): the running count less one is the
    # sample; an empty sample's mark adds to the next one's, which its tokens then follow
    marks = torch.zeros(total + 1, dtype=torch.int64, device=cu.device).index_add(0, cu, torch.ones_like(cu))
    return torch.arange(total, device=cu.device) - cu[marks[:total].cumsum(0) - 1]


def apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                             rotary_interleaved: bool = False, multi_latent_attention: bool = False,
                             mscale: float = 1.0) -> torch.Tensor:
    """RoPE on packed ``t [t, h, d]`` with ``freqs [max_s, 1, 1, d]``: :func:`thd_positions` gathers each
    token's frequencies, then Megatron's own bshd formula rotates all tokens at once."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    packed = freqs[thd_positions(cu_seqlens, t.shape[0])]  # [t, 1, 1, d]
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                      multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)


def _covered(freqs, config, cu_seqlens, cp_group) -> bool:
    return (cu_seqlens is not None and not config.apply_rope_fusion
            and (cp_group is None or cp_group.size() == 1)
            and freqs.dim() == 4 and freqs.shape[1] == 1 and freqs.shape[2] == 1)


def _apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    if _covered(freqs, config, cu_seqlens, cp_group):
        return apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=config.rotary_interleaved,
                                        multi_latent_attention=config.multi_latent_attention, mscale=mscale)
    return _ORIGINAL(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)


def install() -> None:
    """Route the attention module's THD rotary calls through :func:`apply_rotary_pos_emb_thd` (idempotent)."""
    global _ORIGINAL
    from megatron.core.transformer import attention

    if attention.apply_rotary_pos_emb is _apply_rotary_pos_emb:
        return
    _ORIGINAL = attention.apply_rotary_pos_emb
    attention.apply_rotary_pos_emb = _apply_rotary_pos_emb
