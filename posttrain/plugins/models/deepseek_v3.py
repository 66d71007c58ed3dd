"""DeepSeek-V3 architecture (HF ``DeepseekV3ForCausalLM``; Moonlight and Kimi-K2 share it): multi-head
latent attention, DeepSeekMoE routing (sigmoid, expert bias, group-limited top-k), shared experts."""

from __future__ import annotations

import re
from typing import Any

from posttrain import hookimpl
from posttrain.core.errors import UsageError
from posttrain.plugins.trainers.megatron.moe_spec import MoEGPTSpec

_DSV3 = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_act="silu",
             attention_bias=False, rope_interleave=True, norm_topk_prob=True, n_shared_experts=1,
             tie_word_embeddings=False, torch_dtype="bfloat16", num_nextn_predict_layers=1)
_ATTN = re.compile(r"^decoder\.layers\.(\d+)\.self_attention\.(linear_q_proj|linear_q_down_proj|linear_q_up_proj|"
                   r"q_layernorm|linear_kv_down_proj|kv_layernorm|linear_kv_up_proj|linear_proj)\.weight$")
_HF_ATTN = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj", "linear_q_up_proj": "q_b_proj",
            "q_layernorm": "q_a_layernorm", "linear_kv_down_proj": "kv_a_proj_with_mqa",
            "kv_layernorm": "kv_a_layernorm", "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}


def _preset(**kw):
    return {**_DSV3, **kw}


def _latent_norm():
    """The RMSNorm on MLA's q and kv latents: HF builds it with eps 1e-6 whatever ``rms_norm_eps`` says."""
    from posttrain.plugins.trainers.megatron.layers import _rms_norm_module

    class LatentRMSNorm(_rms_norm_module()):  # type: ignore[misc]
        def __init__(self, config, hidden_size: int, eps: float = 1e-6):
            super().__init__(config, hidden_size, 1e-6)

    return LatentRMSNorm


class DeepseekV3Spec(MoEGPTSpec):
    """DeepSeek-V3 decoder on Megatron-core's multi-latent attention (``MLATransformerConfig``).

    Attention per token ``x [H]`` (``n`` heads, ``d_n`` = ``qk_nope_head_dim``, ``d_r`` = ``qk_rope_head_dim``,
    ``d_v`` = ``v_head_dim``, ``c`` = ``kv_lora_rank``)::

        q   = W_qb rms(W_qa x)   (or W_q x without q_lora_rank)   # [n, d_n + d_r]
        ckv, k_r = split(W_kva x, [c, d_r]);  kv = W_kvb rms(ckv) # [n, d_n + d_v]: k_nope, v per head
        k   = [k_nope ; rope(k_r)] (k_r shared by all heads),  q = [q_nope ; rope(q_r)]
        out = W_o softmax(q k^T / sqrt(d_n + d_r)) v

    Rotary dims: HF and Megatron's MLA both rotate the interleaved pairs ``(2i, 2i+1)`` of the ``d_r`` dims
    (``rope_interleave``, the released checkpoints' layout; both reorder them ``[even; odd]`` first), so
    weights map as they are. A checkpoint with ``rope_interleave: false`` (rotated halves) gets those rows
    of ``q_b_proj`` (per head) and ``kv_a_proj_with_mqa`` permuted to the interleaved layout (exact both
    ways). The latent norms use eps 1e-6 as HF's do.

    MoE (HF ``DeepseekV3TopkRouter``, fp32): ``s = sigmoid(x W_r^T)``; the ``topk_group`` best of
    ``n_group`` groups (a group's score: its top-2 ``s + e_score_correction_bias``), the k experts of largest
    ``s + b`` in them, weights ``routed_scaling_factor * s_i / sum_j s_j``; plus ``n_shared_experts`` shared
    experts (one MLP, ungated); the first ``first_k_dense_replace`` layers are dense. Multi-token-prediction
    layers (``num_nextn_predict_layers``, stored past ``num_hidden_layers``) are skipped on load.
    YaRN rope scaling (DeepSeek-V3, Kimi-K2; Moonlight has none) maps to Megatron's ``rope_type="yarn"``:
    ``inv_freq`` ramped between ``beta_fast``/``beta_slow`` corrections, cos/sin times
    ``m(s, mscale) / m(s, mscale_all_dim)`` and the softmax scale times ``m(s, mscale_all_dim)^2``, with
    ``m(s, a) = 0.1 a ln(s) + 1`` (``s`` = ``factor``), as HF computes them.
    """

    name = "deepseek_v3"
    model_types = ("deepseek_v3", "kimi_k2")
    hf_architecture = "DeepseekV3ForCausalLM"
    score_function = "sigmoid"
    expert_bias = True
    shared_experts = True
    load_balancing_type = "seq_aux_loss"
    multi_latent_attention = True
    presets = {
        # 4 layers (the first dense), 4 heads of 16 + 8 rotary dims, latents of 32; 2 groups of 4 experts
        "tiny": _preset(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                        routed_scaling_factor=2.5, max_position_embeddings=512, rope_theta=10000.0,
                        rms_norm_eps=1e-6, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=0,
                        pad_token_id=0, torch_dtype="float32"),
        "moonlight-16B-A3B": _preset(vocab_size=163840, hidden_size=2048, intermediate_size=11264,
                                     moe_intermediate_size=1408, num_hidden_layers=27, first_k_dense_replace=1,
                                     num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                     n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, n_group=1,
                                     topk_group=1, routed_scaling_factor=2.446, max_position_embeddings=8192,
                                     rope_theta=50000.0, rms_norm_eps=1e-5, num_nextn_predict_layers=0,
                                     bos_token_id=163584, eos_token_id=163585),
        "deepseek-v3": _preset(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                               num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
                               num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                               qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                               n_group=8, topk_group=4, routed_scaling_factor=2.5, max_position_embeddings=163840,
                               rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                               rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                                 beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
        "kimi-k2": _preset(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                           num_hidden_layers=61, first_k_dense_replace=1, num_attention_heads=64, num_key_value_heads=64,
                           q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                           n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1,
                           routed_scaling_factor=2.827, max_position_embeddings=131072, rope_theta=50000.0,
                           rms_norm_eps=1e-6, num_nextn_predict_layers=0, bos_token_id=163584, eos_token_id=163585,
                           rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                             beta_fast=1, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    }

    # ------------------------------------------------------------ HF config
    def head_dim(self, hf: dict[str, Any]) -> int:
        return int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])

    @staticmethod
    def _yarn(hf: dict[str, Any]) -> dict[str, Any] | None:
        """HF's YaRN rope parameters (``rope_scaling`` or transformers 5's ``rope_parameters``), or None."""
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        kind = (scaling.get("rope_type") or scaling.get("type")) if isinstance(scaling, dict) else None
        return scaling if kind == "yarn" else None

    def check_supported(self, hf: dict[str, Any]) -> None:
        yarn = self._yarn(hf)
        super().check_supported({k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
                                if yarn else hf)
        if yarn and ("mscale" in yarn) != ("mscale_all_dim" in yarn):
            raise UsageError(f"{self.name}: YaRN rope scaling with only one of mscale / mscale_all_dim is not supported")
        if hf.get("attention_bias"):
            raise UsageError(f"{self.name}: attention_bias: true is not supported (DeepSeek-V3 has none)")
        if int(hf.get("qk_rope_head_dim", 0)) % 2:
            raise UsageError(f"{self.name}: qk_rope_head_dim={hf['qk_rope_head_dim']} must be even")

    def transformer_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        out = super().transformer_config(hf)
        q_rank = hf.get("q_lora_rank")
        out.update(multi_latent_attention=True, q_lora_rank=int(q_rank) if q_rank else None,
                   kv_lora_rank=int(hf["kv_lora_rank"]), qk_head_dim=int(hf["qk_nope_head_dim"]),
                   qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                   num_query_groups=int(hf["num_attention_heads"]), rope_type="rope",
                   rotary_base=float(hf.get("rope_theta", 10000.0)), rotary_scaling_factor=1.0,
                   rotary_interleaved=False, qk_layernorm=True)
        yarn = self._yarn(hf)
        if yarn:  # Megatron's YaRN: the same inv_freq ramp, cos/sin and softmax mscales as HF's (verified)
            out.update(rope_type="yarn", rotary_scaling_factor=float(yarn["factor"]),
                       original_max_position_embeddings=int(yarn.get("original_max_position_embeddings", 4096)),
                       beta_fast=float(yarn.get("beta_fast", 32)), beta_slow=float(yarn.get("beta_slow", 1)),
                       mscale=float(yarn.get("mscale", 1.0)), mscale_all_dim=float(yarn.get("mscale_all_dim", 0.0)))
        return out

    def layer_spec(self, hf: dict[str, Any], core_attention: Any = None) -> Any:
        block = super().layer_spec(hf, core_attention)
        norm = _latent_norm()
        for spec in block.layer_specs:
            spec.submodules.self_attention.submodules.q_layernorm = norm
            spec.submodules.self_attention.submodules.kv_layernorm = norm
        return block

    # ------------------------------------------------------------ names
    def _attention_names(self, hf: dict[str, Any]) -> list[str]:
        q = ["linear_q_down_proj", "q_layernorm", "linear_q_up_proj"] if hf.get("q_lora_rank") else ["linear_q_proj"]
        return [f"self_attention.{n}.weight" for n in
                (*q, "linear_kv_down_proj", "kv_layernorm", "linear_kv_up_proj", "linear_proj")]

    def megatron_names(self, hf: dict[str, Any]) -> list[str]:
        gqa = {"self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
               "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
        out = []
        for name in super().megatron_names(hf):
            m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
            if m and m.group(2) in gqa:
                if m.group(2) == "self_attention.linear_qkv.weight":
                    out += [f"decoder.layers.{m.group(1)}.{n}" for n in self._attention_names(hf)]
                continue
            out.append(name)
        return out

    def hf_sources(self, hf: dict[str, Any], mname: str) -> list[str]:
        m = _ATTN.match(mname)
        if not m:
            return super().hf_sources(hf, mname)
        return [f"model.layers.{m.group(1)}.self_attn.{_HF_ATTN[m.group(2)]}.weight"]

    # ------------------------------------------------------------ tensors
    def _rope_rows(self, hf: dict[str, Any], what: str) -> tuple[int, int, int] | None:
        """``(blocks, rows per block, offset of the d_r rotary rows in a block)`` of a weight whose rows
        hold rotary dims, or None."""
        nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        if what in ("linear_q_proj", "linear_q_up_proj"):
            return int(hf["num_attention_heads"]), nope + rope, nope
        if what == "linear_kv_down_proj":
            return 1, int(hf["kv_lora_rank"]) + rope, int(hf["kv_lora_rank"])
        return None

    def _permute_rope(self, hf: dict[str, Any], what: str, t: Any, inverse: bool) -> Any:
        import torch

        where = self._rope_rows(hf, what)
        if where is None or hf.get("rope_interleave", True):
            return t
        blocks, per, offset = where
        rope = int(hf["qk_rope_head_dim"])
        perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])  # Megatron reads t[perm]
        if not inverse:  # halves -> interleaved: row perm[j] of ours is row j of HF's
            perm = torch.argsort(perm)
        index = torch.cat([torch.arange(offset), offset + perm])
        return t.reshape(blocks, per, -1)[:, index].reshape(t.shape).contiguous()

    def to_megatron(self, hf: dict[str, Any], mname: str, tensors: list[Any]) -> Any:
        m = _ATTN.match(mname)
        if not m:
            return super().to_megatron(hf, mname, tensors)
        (t,) = tensors
        return self._permute_rope(hf, m.group(2), t, inverse=False)

    def to_hf(self, hf: dict[str, Any], mname: str, tensor: Any) -> list[tuple[str, Any]]:
        m = _ATTN.match(mname)
        if not m:
            return super().to_hf(hf, mname, tensor)
        return [(self.hf_sources(hf, mname)[0], self._permute_rope(hf, m.group(2), tensor, inverse=True))]


@hookimpl
def posttrain_register_models(registry):
    registry.add(DeepseekV3Spec)
