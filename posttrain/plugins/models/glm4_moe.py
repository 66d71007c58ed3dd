"""GLM-4.5 / GLM-4.6 (HF ``Glm4MoeForCausalLM``): sigmoid routing with an expert bias, shared experts, dense first layers."""

from __future__ import annotations

from functools import cached_property

from posttrain import hookimpl
from posttrain.plugins.trainers.megatron.moe_spec import MoEGPTSpec

_GLM45 = dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=151552, head_dim=128,
              num_attention_heads=96, num_key_value_heads=8, partial_rotary_factor=0.5, rope_theta=1000000.0,
              attention_bias=True, max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
              n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True,
              num_nextn_predict_layers=1, tie_word_embeddings=False, torch_dtype="bfloat16",
              eos_token_id=[151329, 151336, 151338], pad_token_id=151329)


def _preset(**kw):
    return {**_GLM45, **kw}


class Glm4MoeSpec(MoEGPTSpec):
    """GLM-4.5 decoder (slime's flagship family; GLM-4.6 has the same layout).

    - attention: GQA with q/k/v biases (none on the output projection), rotary on the first half of
      each head (``partial_rotary_factor 0.5``, *not* interleaved, unlike dense GLM-4), per-head q/k
      RMSNorm when ``use_qk_norm`` (GLM-4.5: yes; GLM-4.5-Air: no);
    - the first ``first_k_dense_replace`` layers keep a dense SwiGLU MLP (``intermediate_size``); the
      others are MoE layers: ``n_routed_experts`` experts of width ``moe_intermediate_size`` and
      ``n_shared_experts`` shared ones (one MLP of width ``moe_intermediate_size * n_shared_experts``,
      added ungated: Megatron ``moe_shared_expert_gate=False``);
    - router (HF ``Glm4MoeTopkRouter``, fp32): ``s = sigmoid(x W_r^T)``; choose the k experts of largest
      ``s + e_score_correction_bias`` (within the ``topk_group`` best of ``n_group`` groups); weights
      ``routed_scaling_factor * s_i / sum_j s_j`` over the chosen. Megatron: sigmoid score function, its
      ``expert_bias`` buffer (frozen: ``moe_router_bias_update_rate`` 0), ``moe_router_dtype fp32``;
    - the multi-token-prediction layer (``num_nextn_predict_layers``, stored as layer
      ``num_hidden_layers``) is not part of the causal LM: HF skips it on load, and so do we.
    """

    name = "glm4_moe"
    model_types = ("glm4_moe",)
    hf_architecture = "Glm4MoeForCausalLM"
    qkv_bias = True
    score_function = "sigmoid"
    expert_bias = True
    shared_experts = True
    load_balancing_type = "seq_aux_loss"
    presets = {
        "tiny": _preset(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5,
                        use_qk_norm=True, max_position_embeddings=512, rope_theta=10000.0,
                        num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                        torch_dtype="float32"),
        "glm4.5-air": _preset(hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                              num_hidden_layers=46, first_k_dense_replace=1, n_routed_experts=128,
                              routed_scaling_factor=1.0, use_qk_norm=False),
        "glm4.5": _preset(hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=92,
                          first_k_dense_replace=3, n_routed_experts=160, routed_scaling_factor=2.5, use_qk_norm=True),
    }

    @cached_property
    def qk_norm(self) -> bool:  # type: ignore[override]  # per checkpoint, not per family
        return bool(self.hf_config().get("use_qk_norm", False))


@hookimpl
def posttrain_register_models(registry):
    registry.add(Glm4MoeSpec)
