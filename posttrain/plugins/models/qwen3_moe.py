"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B; HF ``Qwen3MoeForCausalLM``): Qwen3 attention, softmax top-k routing."""

from __future__ import annotations

from posttrain import hookimpl
from posttrain.plugins.trainers.megatron.moe_spec import MoEGPTSpec

_QWEN3_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, head_dim=128,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, hidden_act="silu",
                  attention_bias=False, torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], router_aux_loss_coef=0.001, tie_word_embeddings=False)


def _preset(**kw):
    return {**_QWEN3_MOE, **kw}


class Qwen3MoeSpec(MoEGPTSpec):
    """Qwen3-MoE decoder: Qwen3's attention (q/k RMSNorm per head, GQA, no biases) and a MoE MLP in every
    layer (``decoder_sparse_step`` 1, no ``mlp_only_layers`` in the released models; both honoured).

    Router (HF ``Qwen3MoeTopKRouter``): ``p = softmax(x W_r^T)`` in fp32, top-k of ``p``, renormalized
    to sum 1 when ``norm_topk_prob`` (Megatron: top-k of the logits, then softmax over those k, the same
    weights); no shared expert, no expert bias. HF's ``router_aux_loss_coef`` is a pre-training
    setting: RL runs start with the aux loss off (``trainer.backend.megatron.moe_aux_loss_coeff`` turns it
    on); ``train/moe_aux_loss`` is logged either way.
    """

    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    hf_architecture = "Qwen3MoeForCausalLM"
    qk_norm = True
    score_function = "softmax"
    presets = {
        # 8 experts of width 32, 4 per token: the dense tiny preset's MLP width (128) per token
        "tiny": _preset(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        num_experts=8, num_experts_per_tok=4, max_position_embeddings=512, rope_theta=10000.0,
                        bos_token_id=0, eos_token_id=0, torch_dtype="float32"),
        "qwen3-30B-A3B": _preset(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4),
        "qwen3-235B-A22B": _preset(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                                   num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4),
    }


@hookimpl
def posttrain_register_models(registry):
    registry.add(Qwen3MoeSpec)
