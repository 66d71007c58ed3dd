"""Qwen2 / Qwen2.5 dense (qwen2.5-0.5B ... 7B): Llama-style with q/k/v biases."""

from __future__ import annotations

from posttrain import hookimpl
from posttrain.plugins.trainers.megatron.spec import DenseGPTSpec

_QWEN2 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936, rms_norm_eps=1e-6,
              rope_theta=1000000.0, max_position_embeddings=32768, hidden_act="silu", torch_dtype="bfloat16",
              bos_token_id=151643, eos_token_id=151643)


def _preset(**kw):
    return {**_QWEN2, **kw}


class Qwen2Spec(DenseGPTSpec):
    """Qwen2 / Qwen2.5 dense decoder: RMSNorm, rotary (theta 1e6), SwiGLU, GQA, bias on q, k and v.

    Megatron: local GPT layer spec, ``add_qkv_bias=True``: ``linear_qkv.bias [ng*(np/ng+2)*hd]`` fused per
    query group like the weight; no other biases. Small presets tie the output layer to the embeddings.
    """

    name = "qwen2"
    model_types = ("qwen2",)
    hf_architecture = "Qwen2ForCausalLM"
    qkv_bias = True
    presets = {
        "tiny": _preset(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                        torch_dtype="float32"),
        "qwen2.5-0.5B": _preset(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
        "qwen2.5-1.5B": _preset(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
        "qwen2.5-7B": _preset(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                              num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                              tie_word_embeddings=False),
    }


@hookimpl
def posttrain_register_models(registry):
    registry.add(Qwen2Spec)
