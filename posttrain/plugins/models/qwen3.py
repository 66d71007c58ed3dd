"""Qwen3 dense (qwen3-0.6B ... 8B): Llama-style with a per-head RMSNorm on q and k, no q/k/v bias."""

from __future__ import annotations

from posttrain import hookimpl
from posttrain.plugins.trainers.megatron.spec import DenseGPTSpec

_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, head_dim=128,
              rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, hidden_act="silu",
              attention_bias=False, torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)


def _preset(**kw):
    return {**_QWEN3, **kw}


class Qwen3Spec(DenseGPTSpec):
    """Qwen3 dense decoder: RMSNorm, rotary (theta 1e6), SwiGLU, GQA, q/k RMSNorm per head.

    Megatron: local GPT layer spec with ``qk_layernorm=True`` (``q_layernorm``/``k_layernorm`` <-
    ``self_attn.q_norm``/``k_norm``, ``[head_dim]``); fused ``linear_qkv [ng*(np/ng+2)*hd, h]`` per query
    group; ``linear_fc1 = [gate; up]``. Small presets tie the output layer to the embeddings.
    """

    name = "qwen3"
    model_types = ("qwen3",)
    hf_architecture = "Qwen3ForCausalLM"
    qk_norm = True
    presets = {
        "tiny": _preset(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                        torch_dtype="float32"),
        # half of tiny's width (hidden 32, 2 heads): the student of the CPU distillation example
        "tiny-small": _preset(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                              rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                              torch_dtype="float32"),
        "qwen3-0.6B": _preset(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
        "qwen3-1.7B": _preset(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
        "qwen3-4B": _preset(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
        "qwen3-8B": _preset(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    }


@hookimpl
def posttrain_register_models(registry):
    registry.add(Qwen3Spec)
