"""Llama 3 dense (llama3-8B): RMSNorm, rotary (theta 5e5), SwiGLU, GQA, no biases."""

from __future__ import annotations

from posttrain import hookimpl
from posttrain.plugins.trainers.megatron.spec import DenseGPTSpec


class Llama3Spec(DenseGPTSpec):
    """Llama 3 decoder (HF ``model_type: llama``): the plain dense layout every other family extends.

    Megatron: local GPT layer spec; ``linear_qkv`` fused per query group, ``linear_fc1 = [gate; up]``.
    Llama 3.1's ``rope_scaling: llama3`` frequency rescaling is not mapped: such a config is refused.
    """

    name = "llama3"
    model_types = ("llama",)
    hf_architecture = "LlamaForCausalLM"
    presets = {
        "tiny": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, torch_dtype="float32"),
        "llama3-8B": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                          hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                          rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False,
                          bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16"),
    }


@hookimpl
def posttrain_register_models(registry):
    registry.add(Llama3Spec)
