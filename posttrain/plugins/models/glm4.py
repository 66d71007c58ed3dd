"""GLM-4 dense (glm4-9B, HF ``Glm4ForCausalLM``): sandwich norms, half-dim interleaved rotary, q/k/v bias."""

from __future__ import annotations

from posttrain import hookimpl
from posttrain.plugins.trainers.megatron.spec import DenseGPTSpec


class Glm4Spec(DenseGPTSpec):
    """GLM-4 decoder (slime's quick-start model glm-4-9b, HF ``model_type: glm4``).

    Differences from Llama, and their Megatron form:

    - rotary on the first half of each head (``partial_rotary_factor 0.5`` -> ``rotary_percent``), with
      interleaved pairs ``(x0, x1), (x2, x3) ...`` -> ``rotary_interleaved=True``;
    - extra RMSNorms on the attention and MLP outputs (``post_self_attn_layernorm``,
      ``post_mlp_layernorm``) -> ``self_attention.post_norm`` / ``mlp.post_norm`` wrappers
      (:mod:`posttrain.plugins.trainers.megatron.layers`);
    - biases on q, k, v -> ``add_qkv_bias``; HF's fused ``mlp.gate_up_proj`` is already ``[gate; up]``.
    """

    name = "glm4"
    model_types = ("glm4",)
    hf_architecture = "Glm4ForCausalLM"
    qkv_bias = True
    post_norms = True
    fused_gate_up = True
    rotary_interleaved = True
    presets = {
        "tiny": dict(model_type="glm4", architectures=["Glm4ForCausalLM"], vocab_size=128, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, partial_rotary_factor=0.5, attention_bias=True, max_position_embeddings=512,
                     rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="float32"),
        "glm4-9B": dict(model_type="glm4", architectures=["Glm4ForCausalLM"], vocab_size=151552, hidden_size=4096,
                        intermediate_size=13696, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2,
                        head_dim=128, partial_rotary_factor=0.5, attention_bias=True, max_position_embeddings=32768,
                        rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
                        bos_token_id=None, eos_token_id=[151329, 151336, 151338], pad_token_id=151329,
                        torch_dtype="bfloat16"),
    }


@hookimpl
def posttrain_register_models(registry):
    registry.add(Glm4Spec)
