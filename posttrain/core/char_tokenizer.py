"""posttrain's character-level tokenizer: what ``model.tokenizer: char`` selects, and what tiny test models use.

Every printable ASCII character is one token, after Qwen-style chat special tokens, so a model trained on
CPU with no download has a real HF tokenizer (``tokenizer.json``, a chat template) that SGLang-protocol
engines and ``transformers`` load like any hub tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>"]
CHARS = list(string.printable)  # digits, letters, punctuation, whitespace: 100 characters
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# vision-language checkpoints (``make_tokenizer(vision=True)``): these after the characters, and a chat template
# that renders a content list's ``{"type": "image"}`` items as Qwen2-VL does
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(out_dir: str | Path | None = None, vision: bool = False):
    """A character-level ``PreTrainedTokenizerFast`` (vocab: special tokens, then printable ASCII, then with
    ``vision`` :data:`VISION_TOKENS` and :data:`VISION_CHAT_TEMPLATE`).

    ``eos`` and ``pad`` are ``<|endoftext|>`` (id 0); ``<|im_end|>`` (id 2) also ends a chat turn.
    Saved to ``out_dir`` when given.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    extra = VISION_TOKENS if vision else []
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + extra)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL_TOKENS[1:] + extra)
    tok.chat_template = VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    if out_dir is not None:
        tok.save_pretrained(str(out_dir))
    return tok
