"""Shared steps of generators: the engine's tokenizer, prompt token ids, and filling a Sample from answers.

Token in, token out: prompts are tokenized here once; response tokens and log-probs come from the
engine's ``output_token_logprobs``; ``Sample.response`` is the engine's text, never re-tokenized.
"""

from __future__ import annotations

import weakref
from typing import Any

from posttrain.core.types import Sample, SampleStatus

_TOKENIZERS: dict[str, Any] = {}


_PATHS: dict[str, str] = {}


async def engine_tokenizer(engine) -> Any:
    """The tokenizer at the engine's ``tokenizer_path`` (``/get_model_info``), loaded once per process.

    The path is asked once per engine URL: every later rollout skips the round trip, and a router whose
    worker just died cannot fail it."""
    key = getattr(engine, "base_url", None) or str(id(engine))
    if key not in _PATHS:
        info = await engine.get_model_info()
        _PATHS[key] = info.get("tokenizer_path") or info["model_path"]
    path = _PATHS[key]
    if path not in _TOKENIZERS:
        import asyncio

        from transformers import AutoTokenizer

        _TOKENIZERS[path] = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
    return _TOKENIZERS[path]


_IMAGES: dict[str, Any] = {}


async def engine_images(engine) -> Any:
    """The engine's model's :class:`~posttrain.core.vision.ImageInputs` (image processor and image token), read
    from its ``tokenizer_path`` once per process (a vision-language checkpoint's files)."""
    await engine_tokenizer(engine)
    path = _PATHS[getattr(engine, "base_url", None) or str(id(engine))]
    if path not in _IMAGES:
        import asyncio

        from posttrain.core.vision import ImageInputs

        _IMAGES[path] = await asyncio.to_thread(ImageInputs.from_dir, path)
    return _IMAGES[path]


async def with_images(group: list[Sample], prompts: list[list[int]], engine) -> tuple[list[list[int]], list | None]:
    """``(prompt ids, image_data)`` of ``group``: each prompt's image tokens expanded to the count its images take
    (once per distinct prompt and images; :meth:`ImageInputs.expand`), and the per-prompt lists of image references
    SGLang's ``image_data`` takes; ``(prompts, None)`` for a group without images."""
    if not any(s.images for s in group):
        return prompts, None
    import asyncio

    vision = await engine_images(engine)

    def expand() -> list[list[int]]:
        done: dict[tuple, list[int]] = {}
        out = []
        for s, ids in zip(group, prompts):
            key = (tuple(ids), tuple(s.images or ()))
            if key not in done:  # counted from the images' sizes: no pixels here
                done[key] = vision.expand(ids, s.images, pixels=False)[0] if s.images else list(ids)
            out.append(list(done[key]))
        return out

    return await asyncio.to_thread(expand), [list(s.images or []) for s in group]


def prompt_ids(sample: Sample, tokenizer: Any, chat_template: bool = True) -> list[int]:
    """Token ids of the prompt: chat messages go through the chat template (with the generation prompt),
    a string is tokenized as it is (``data.apply_chat_template``, the one switch, rendered it at load time
    if asked). ``chat_template=False`` refuses chat messages (kept for callers that passed it)."""
    if sample.tokens and sample.response_length == 0:
        return list(sample.tokens)
    if isinstance(sample.prompt, list):
        if not chat_template:
            raise ValueError("a chat-message prompt needs chat_template: true")
        text = tokenizer.apply_chat_template(sample.prompt, add_generation_prompt=True, tokenize=False)
        return encode_cached(tokenizer, text)
    return encode_cached(tokenizer, sample.prompt)


_ENCODED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {text: ids}, token count
_ENCODED_MAX_TOKENS = 1 << 21  # token ids kept per tokenizer (~70 MB); the cache starts over when full


def encode_cached(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)``, remembered per tokenizer: an epoch repeats
    every prompt, and a group's samples share theirs (HF's per-call overhead is ~0.1 ms)."""
    try:
        cache = _ENCODED.setdefault(tokenizer, [{}, 0])
    except TypeError:  # not weak-referenceable: no cache
        return tokenizer.encode(text, add_special_tokens=False)
    seen = cache[0]
    ids = seen.get(text)
    if ids is None:
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if cache[1] + len(ids) > _ENCODED_MAX_TOKENS:
            seen.clear()
            cache[1] = 0
        seen[text] = ids
        cache[1] += len(ids)
    return list(ids)


STATUS = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED, "stop": SampleStatus.COMPLETED}


def finish_type(response: dict[str, Any]) -> str:
    reason = response.get("meta_info", {}).get("finish_reason") or {}
    return reason.get("type", "stop") if isinstance(reason, dict) else str(reason)


def routed_experts(response: dict[str, Any], rows: int) -> Any:
    """SGLang's ``meta_info.routed_experts`` (base64 int32, ``[tokens read, L, k]`` in C order) as an int32
    array ``[rows, L * k]``: rows past the answer's (tokens the engine did not read, e.g. a tool result
    appended after the last turn) are -1; None when the answer has none."""
    import base64

    import numpy as np

    raw = response.get("meta_info", {}).get("routed_experts")
    if not raw:
        return None
    flat = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    have = int(response["meta_info"].get("prompt_tokens", 0)) + int(response["meta_info"].get("completion_tokens", 0)) - 1
    if have <= 0 or flat.size % have:
        raise ValueError(f"routed_experts: {flat.size} ids do not split into {have} tokens")
    out = np.full((rows, flat.size // have), -1, dtype=np.int32)
    n = min(rows, have)
    out[:n] = flat.reshape(have, -1)[:n]
    return out


def fill(sample: Sample, prompt: list[int], response_ids: list[int], mask: list[int], logprobs: list[float],
         text: str, finish: str, weight_version: int, last_response: dict[str, Any] | None = None,
         weight_versions: list[int] | None = None) -> Sample:
    """Write the rollout into ``sample`` (``tokens`` = prompt + response; mask/log-probs cover the response).
    ``last_response``: the last ``/generate`` answer, whose ``routed_experts`` (if any) cover the tokens.
    ``weight_versions``: each response token's weight version; by default read from ``last_response``
    (:func:`~posttrain.core.rollout.preempt.token_weight_versions`) when it holds the whole response."""
    from posttrain.core.rollout.preempt import token_weight_versions

    sample.tokens = list(prompt) + list(response_ids)
    if last_response is not None:
        sample.rollout_routed_experts = routed_experts(last_response, len(sample.tokens) - 1)
    sample.response_length = len(response_ids)
    sample.response = text
    sample.loss_mask = list(mask)
    sample.rollout_log_probs = list(logprobs)
    sample.finish_reason = finish
    sample.status = STATUS.get(finish, SampleStatus.COMPLETED)
    sample.weight_version = weight_version
    if weight_versions is None:
        weight_versions = (token_weight_versions(last_response, len(response_ids)) if last_response is not None
                           else [weight_version] * len(response_ids))
    sample.weight_versions = list(weight_versions)
    return sample
