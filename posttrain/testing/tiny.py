"""Tiny HF-format checkpoints and tokenizers built in code, for tests, benchmarks and the CPU quickstart.

Nothing can be downloaded in CI, so every model a test uses is made here: a character-level tokenizer
(every printable ASCII character is one token, plus Qwen-style chat special tokens) and a randomly
initialized ``transformers`` model of the requested family, saved as ``config.json`` +
``model.safetensors`` + tokenizer files, exactly as a hub checkpoint would be laid out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.core.char_tokenizer import CHARS, CHAT_TEMPLATE, SPECIAL_TOKENS, make_tokenizer

# the character tokenizer lives in core (``model.tokenizer: char`` selects it); its names stay importable here
__all__ = ["CHARS", "CHAT_TEMPLATE", "FAMILIES", "SPECIAL_TOKENS", "make_tiny_checkpoint", "make_tokenizer",
           "tiny_config"]

# family -> transformers config class name
FAMILIES = {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config", "llama": "LlamaConfig", "glm4": "Glm4Config",
            "qwen3_moe": "Qwen3MoeConfig", "glm4_moe": "Glm4MoeConfig", "deepseek_v3": "DeepseekV3Config"}
# MoE families: 8 experts of width 32 (Qwen3-MoE: 4 per token; GLM: 2, a dense first layer, a shared
# expert, sigmoid routing with a scaling factor, q/k norms): the spec presets named ``tiny`` have these shapes
_MOE = {"qwen3_moe": dict(head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=4,
                          norm_topk_prob=True),
        "glm4_moe": dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                         num_hidden_layers=3, first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1,
                         routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                         partial_rotary_factor=0.5, rms_norm_eps=1e-5, num_nextn_predict_layers=0),
        # DeepSeek-V3: multi-head latent attention (q and kv low-rank, 8 rotary dims of 24 per q/k head,
        # interleaved), 2 groups of 4 experts with one group chosen per token, 4 layers (PP=2 splits them)
        "deepseek_v3": dict(num_hidden_layers=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
                            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                            rope_interleave=True, num_nextn_predict_layers=0)}


def tiny_config(family: str = "qwen3", **overrides: Any):
    """A small ``transformers`` config of ``family`` (2 layers, hidden 64, GQA 4/2, vocab 128)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    kwargs: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    if family in ("qwen3", "glm4"):
        kwargs["head_dim"] = 16
    if family == "glm4":  # half-dim interleaved rotary, q/k/v bias, sandwich norms (the glm4 spec's tiny preset)
        kwargs.update(partial_rotary_factor=0.5, attention_bias=True, rms_norm_eps=1e-5)
    kwargs.update(_MOE.get(family, {}))
    kwargs.update(overrides)
    return getattr(transformers, FAMILIES[family])(**kwargs)


def make_tiny_checkpoint(out_dir: str | Path, family: str = "qwen3", seed: int = 0, dtype: str = "float32",
                         **overrides: Any) -> Path:
    """Write a randomly initialized ``family`` model and the tokenizer to ``out_dir``; return the path."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # HF starts GLM's expert bias at 0: a random one makes a test see its mapping
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
    model.save_pretrained(str(out), safe_serialization=True)
    make_tokenizer(out)
    return out


def tiny_vlm_config(**overrides: Any):
    """A small Qwen2.5-VL config: the tiny text shape (2 layers, hidden 64, GQA 4/2, vocab 128, multimodal
    rotary sections 2/3/3 of the 8 rotary pairs) and a 2-block vision tower of width 32 (14-pixel patches,
    2 x 2 merged, so a 56 x 56 image is 4 image tokens). Image and vision token ids are the vision tokenizer's."""
    import transformers

    from posttrain.core.char_tokenizer import CHARS, SPECIAL_TOKENS, VISION_TOKENS

    ids = {t: len(SPECIAL_TOKENS) + len(CHARS) + i for i, t in enumerate(VISION_TOKENS)}
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=0, eos_token_id=0, pad_token_id=0)
    text.update(overrides.pop("text_config", {}))
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1], tokens_per_second=2)
    vision.update(overrides.pop("vision_config", {}))
    return transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], **{"tie_word_embeddings": False, **overrides})


def make_tiny_vlm_checkpoint(out_dir: str | Path, seed: int = 0, max_pixels: int = 112 * 112, dtype: str = "float32",
                             device: str = "cpu", **overrides: Any) -> Path:
    """Write a randomly initialized tiny Qwen2.5-VL (:func:`tiny_vlm_config`; ``overrides`` reshape it, e.g.
    ``text_config={...}, vision_config={...}`` for a full-size shape, drawn on ``device`` in ``dtype``), the
    character tokenizer with the vision tokens and chat template, and Qwen2-VL's image processor
    (``preprocessor_config.json``: 14-pixel patches, merge 2, images resized to between 56 x 56 and
    ``max_pixels`` pixels) to ``out_dir``."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(tiny_vlm_config(**overrides), dtype=getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    make_tokenizer(out, vision=True)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels, patch_size=14, temporal_patch_size=2,
                             merge_size=2).save_pretrained(str(out))
    return out
