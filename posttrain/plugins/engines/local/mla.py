"""Multi-head latent attention (DeepSeek-V2/V3, Moonlight, Kimi-K2) in the local engine, over a latent cache.

Per token the cache holds one row of ``c + r`` numbers (``c`` = ``kv_lora_rank``, ``r`` = ``qk_rope_head_dim``):
the normalized kv latent ``rms(ckv)`` and the rotated shared key ``rope(k_r)``; no per-head keys or values.
The runner's ``k_cache`` is ``[L, N, 1, S_max, c + r]`` (one "head"); ``v_cache`` is a view of it (the
first ``c`` numbers of each row: the values of the latent attention), no memory of its own.

With ``kv_b_proj`` split per head ``i`` into ``W_uk[i] [d_n, c]`` and ``W_uv[i] [d_v, c]``, the up-projections
are absorbed into the query and the output (as SGLang's MLA decode does)::

    q_nope[i] . (W_uk[i] c_t) = (W_uk[i]^T q_nope[i]) . c_t
    q_abs[i]  = [W_uk[i]^T q_nope[i] ; rope(q_r[i])]                        # [c + r]
    a[i, t]   = softmax_t(q_abs[i] . cache[t] * scaling)                     # scaling = 1/sqrt(d_n + r)
    o[i]      = W_uv[i] (sum_t a[i, t] cache[t, :c])                         # [d_v]

which is HF's attention (``DeepseekV3Attention``: expanded keys ``[k_nope ; k_r]``, values ``W_uv c``) with
the sums regrouped: equal up to float rounding. The attention is one multi-query attention over the latent
rows (keys: whole rows, values: their first ``c`` numbers). The rotary is the checkpoint's own
(``rope_interleave``: interleaved pairs, HF's ``apply_rotary_pos_emb_interleave``).

The rest of the layer (``o_proj``, residuals, the MoE MLP and its routing) is ``layers.finish_layer``. In exact
mode (``rollout.exact``) ``exact_mode.ExactLatentAttention`` keeps this cache but expands keys and values from it
instead of absorbing the up-projections (the trainer's order of sums).
Eager torch (no Triton kernel, no CUDA graph, no compile): the runner turns those off for MLA.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.plugins.engines.local.layers import embed_and_rotary, finish_layer


def is_mla(model: Any) -> bool:
    """Whether the HF model's attention is multi-head latent attention."""
    return hasattr(model.model.layers[0].self_attn, "kv_lora_rank")


class LatentAttention:
    """The MLA parts of one model: its cache row width and the prefill and decode attentions."""

    def __init__(self, model: Any):
        cfg = model.config
        self.rank, self.rope_dim = int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
        self.nope, self.v_dim = int(cfg.qk_nope_head_dim), int(cfg.v_head_dim)
        self.heads = int(cfg.num_attention_heads)
        self.width = self.rank + self.rope_dim  # one cache row
        self.interleaved = bool(getattr(cfg, "rope_interleave", True))
        module = sys.modules[type(model).__module__]
        self._rope = (module.apply_rotary_pos_emb_interleave if self.interleaved else module.apply_rotary_pos_emb)

    def _up(self, attn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_uk [H, d_n, c], W_uv [H, d_v, c])``: views of ``kv_b_proj.weight [H (d_n + d_v), c]``."""
        w = attn.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope:]

    def project(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm and projections: ``h [n, q, hidden]`` -> ``(q_abs [n, H, q, c + r], rows [n, q, c + r])``."""
        attn = layer.self_attn
        n, q_len, _ = h.shape
        x = layer.input_layernorm(h)
        q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q = q.view(n, q_len, self.heads, self.nope + self.rope_dim).transpose(1, 2)  # [n, H, q, d_n + r]
        q_nope, q_r = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_r = attn.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = attn.kv_a_layernorm(latent)
        q_r, k_r = self._rope(q_r, k_r[:, None], cos, sin)  # k_r: [n, 1, q, r], shared by the heads
        w_uk, _ = self._up(attn)
        q_abs = torch.cat([torch.einsum("nhqd,hdc->nhqc", q_nope, w_uk), q_r], dim=-1)
        return q_abs, torch.cat([latent, k_r[:, 0]], dim=-1)

    def output(self, layer: Any, o: torch.Tensor) -> torch.Tensor:
        """Attention over latents ``o [n, H, q, c]`` -> per-head values ``[n, H, q, d_v]``."""
        _, w_uv = self._up(layer.self_attn)
        return torch.einsum("nhqc,hvc->nhqv", o, w_uv)

    def project_qkv(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Any = None,
                    qkv: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill's ``layers.project_qkv``: ``(q_abs [n, H, P, c + r], keys [n, 1, P, c + r], values
        [n, 1, P, c])``, the values a view of the keys (the runner's ``v_cache`` is a view of its ``k_cache``,
        so writing both writes the latent rows once more in place); ``rope``, ``qkv``: unused."""
        q_abs, rows = self.project(layer, h, cos, sin)
        keys = rows[:, None]
        return q_abs, keys, keys[..., : self.rank]

    def finish(self, layer: Any, h: torch.Tensor, o: torch.Tensor, gate_up: Any = None):
        """``layers.finish_layer`` after the up-projection of the attention over latents ``o [n, H, q, c]``."""
        return finish_layer(layer, h, self.output(layer, o), gate_up)

    def decode(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float,
               cache: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        """One token per slot ``h [nb, 1, hidden]`` at ``positions [nb]``: its latent row goes into ``cache``
        (``[N, 1, S_max, c + r]``, this layer's) at its position, then it attends to rows ``0 .. position``.
        Returns the per-head values ``[nb, H, 1, d_v]``."""
        nb = h.shape[0]
        q_abs, rows = self.project(layer, h, cos, sin)
        slots = torch.arange(nb, device=h.device)
        cache[slots, 0, positions] = rows[:, 0].to(cache.dtype)
        kv = cache[:nb, :, :span]  # [nb, 1, span, c + r]
        visible = torch.arange(span, device=h.device)[None, :] <= positions[:, None]  # [nb, span]
        o = F.scaled_dot_product_attention(q_abs, kv, kv[..., : self.rank], attn_mask=visible[:, None, None],
                                           scale=scaling, enable_gqa=True)
        return self.output(layer, o)


def decode_step(runner: Any, tokens: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
    """``ModelRunner._decode_eager`` for an MLA model: ``tokens``/``positions`` ``[nb]`` -> logits ``[nb, V]``;
    the step's expert ids go to ``runner._step_routing`` as the GQA step leaves them."""
    model = runner.model.model
    h, cos, sin = embed_and_rotary(model, tokens[:, None], positions[:, None])
    routed = []
    for l, layer in enumerate(runner.layers):
        o = runner.mla.decode(layer, h, cos, sin, runner.scaling, runner.k_cache[l], positions, span)
        h, experts = finish_layer(layer, h, o, runner._parts(layer)[1])
        routed.append(experts)
    runner._step_routing = runner._stack_routing(routed, (tokens.shape[0],))
    logits = runner.model.lm_head(model.norm(h[:, -1]))
    return logits.float() if runner.float_logits else logits


def adopt_latent_attention(runner: Any) -> LatentAttention:
    """Turn a ``ModelRunner`` of an MLA model to this module's attention: the latent cache ``k_cache [L, N, 1,
    S_max, c + r]`` (``v_cache``: the view of its first ``c`` numbers), the prefill parts above and
    :func:`decode_step`. Eager torch: no CUDA graphs, compile, Triton attention or Triton cache write."""
    mla = LatentAttention(runner.model)
    runner.head_dim, runner.num_kv_heads = mla.width, 1
    shape = (runner.num_layers, runner.max_slots, 1, runner.context_length, mla.width)
    runner.k_cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
    runner.v_cache = runner.k_cache[..., : mla.rank]
    runner.cuda_graphs = runner.compile = runner.join_layers = runner.prefill_kv_kernel = False
    runner.rope_in_attention = runner.attention_writes_kv = False
    runner.decode_attention = "sdpa"
    runner._prefill_parts = (mla.project_qkv, mla.finish)
    runner._decode_eager = functools.partial(decode_step, runner)
    return mla
