"""SFT data: labelled rows -> token ids with a loss mask, and the batches of each epoch.

Rows are read like prompt data (``.jsonl``/``.json``/``.parquet`` or a saved HF dataset, ``path@[a:b]``
slices, every bad row reported as ``file:line: message``). Two shapes:

- **prompt/response** ``{"prompt": "3+4=", "response": "7"}`` (keys ``data.input_key`` and the mode's
  ``response_key``). Without a chat template the tokens are ``tok(prompt) + tok(response) [+ EOS]``, the
  prompt tokenized alone exactly as an RL engine receives it, and the loss covers the response (and
  EOS). With ``data.apply_chat_template`` (or a prompt given as chat messages) the row becomes the
  conversation ``prompt + [{"role": "assistant", "content": response}]`` below.
- **messages** ``{"messages": [{role, content}, ...]}`` (the mode's ``messages_key``): rendered with the
  tokenizer's chat template; the loss covers every assistant turn (its content and end-of-turn
  marker, as the template writes them) and nothing else: system, user and tool turns and the
  generation prompts (``<|im_start|>assistant\\n``) are masked. Assistant turn ``i``'s tokens are those
  between ``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i + 1])``; a
  template whose renders are not prefixes of one another (one that rewrites earlier turns, as Qwen3's
  does with thinking blocks) is reported for that row rather than trained with wrong masks.

Samples longer than the mode's ``max_len`` are cut to it (a sample with no trained token left is
dropped and counted). Column ``t`` of the mask says whether ``tokens[t]`` is trained, aligned as
:class:`~posttrain.core.train_batch.TrainBatch` is (column 0 has no prefix and is never trained).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.core.data import MAX_ERRORS_SHOWN, DataError, read_records, split_slice


@dataclass
class SFTExample:
    """One labelled sample: ``tokens`` and the 0/1 ``mask`` of the tokens trained on (same length)."""

    tokens: list[int]
    mask: list[int]
    source: str = ""

    @property
    def trained(self) -> int:
        return sum(self.mask)


@dataclass
class SFTDataset:
    """The encoded samples plus what loading left out: bad rows skipped (``data.on_bad_row: skip``),
    samples cut to ``max_len`` (``truncated``) and those with no trained token left (``dropped``)."""

    examples: list[SFTExample]
    path: str = ""
    skipped: int = 0
    truncated: int = 0
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.examples)

    def summary(self) -> str:
        tokens = sum(len(e.tokens) for e in self.examples)
        trained = sum(e.trained for e in self.examples)
        return (f"{self.path}: {len(self.examples)} samples, {tokens} tokens ({trained} trained); "
                f"{self.skipped} bad rows skipped, {self.truncated} cut to max_len, {self.dropped} dropped")


def _messages_problem(value: Any) -> str | None:
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and (
                isinstance(m.get("content"), (str, list)) or (m.get("content") is None and m.get("tool_calls")))
            for m in value):
        return None
    text = json.dumps(value, default=str)
    return f"must be a non-empty list of chat messages {{role, content}}, got {text[:60]}"


def encode_row(record: Any, data: Any, mode: Any, tokenizer: Any) -> tuple[SFTExample | None, str | None]:
    """One raw record -> ``(SFTExample, None)`` or ``(None, what is wrong)``. ``data``: the run's
    ``DataConfig`` (``input_key``, ``tools_key``, ``apply_chat_template``, ``chat_template_kwargs``);
    ``mode``: the SFT mode's config (``response_key``, ``messages_key``, ``add_eos``)."""
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    kwargs = dict(data.chat_template_kwargs)
    tools = record.get(data.tools_key)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            return None, f"{data.tools_key!r} is a string that is not JSON"
    if tools is not None:
        kwargs["tools"] = tools
    if mode.messages_key in record:
        messages = record[mode.messages_key]
        problem = _messages_problem(messages)
        if problem:
            return None, f"{mode.messages_key!r} {problem}"
        return _encode_chat(messages, tokenizer, kwargs)
    if data.input_key not in record or mode.response_key not in record:
        keys = ", ".join(map(str, record)) or "(none)"
        return None, (f"needs {mode.messages_key!r} (chat messages) or {data.input_key!r} and "
                      f"{mode.response_key!r} (data.input_key, mode.response_key); the row has: {keys}")
    prompt, response = record[data.input_key], record[mode.response_key]
    if not isinstance(response, str) or not response:
        return None, f"{mode.response_key!r} must be a non-empty string"
    if isinstance(prompt, list) or data.apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        problem = _messages_problem(messages)
        if problem:
            return None, f"{data.input_key!r} {problem}"
        return _encode_chat(list(messages) + [{"role": "assistant", "content": response}], tokenizer, kwargs)
    if not isinstance(prompt, str) or not prompt:
        return None, f"{data.input_key!r} must be a non-empty string or chat messages"
    head = tokenizer.encode(prompt, add_special_tokens=False)
    tail = tokenizer.encode(response, add_special_tokens=False)
    if mode.add_eos:
        if tokenizer.eos_token_id is None:
            return None, "add_eos: the tokenizer has no EOS token (set mode.add_eos: false)"
        tail.append(tokenizer.eos_token_id)
    return SFTExample(head + tail, [0] * len(head) + [1] * len(tail)), None


def _encode_chat(messages: list[dict[str, Any]], tokenizer: Any, kwargs: dict[str, Any]
                 ) -> tuple[SFTExample | None, str | None]:
    """The chat-template rendering of ``messages`` with a mask over the assistant turns."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None, "the tokenizer has no chat template (needed for chat messages)"

    def ids(upto: int, generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages[:upto], tokenize=False,
                                             add_generation_prompt=generation_prompt, **kwargs)
        return tokenizer.encode(text, add_special_tokens=False)

    try:
        tokens = ids(len(messages), False)
        mask = [0] * len(tokens)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = ids(i, True) if i else [], ids(i + 1, False)
            if tokens[:len(before)] != before or tokens[:len(through)] != through:
                return None, (f"the chat template does not render turn {i} as a prefix of the whole "
                              f"conversation, so its loss mask cannot be found")
            mask[len(before):len(through)] = [1] * (len(through) - len(before))
    except Exception as exc:  # a template error names the row, never a traceback
        return None, f"the chat template failed: {type(exc).__name__}: {exc}"
    if not any(mask):
        return None, "no assistant turn to train on"
    return SFTExample(tokens, mask), None


def load_sft(path: str, data: Any, mode: Any, tokenizer: Any, base_dir: str | Path = ".") -> SFTDataset:
    """Read and encode the rows at ``path`` (``path@[a:b]`` slices). Raises :class:`DataError` with every
    bad row as ``file:line: message`` unless ``data.on_bad_row`` is ``skip``."""
    local, rows = split_slice(path)
    file = Path(local)
    if not file.is_absolute() and not file.exists() and (Path(base_dir) / local).exists():
        file = Path(base_dir) / local
    if not file.exists():
        raise DataError([f"{path}: no such file or directory"])
    records = list(read_records(file))
    if rows is not None:
        records = records[rows]
    dataset, errors = SFTDataset([], str(file)), []
    for where, record, problem in records:
        example = None
        if problem is None:
            example, problem = encode_row(record, data, mode, tokenizer)
        if problem is not None:
            errors.append(f"{where}: {problem}")
            continue
        example.mask[0] = 0  # column 0 has no prefix to predict it from
        if mode.max_len is not None and len(example.tokens) > mode.max_len:
            example.tokens, example.mask = example.tokens[:mode.max_len], example.mask[:mode.max_len]
            dataset.truncated += 1
            if not any(example.mask):
                dataset.dropped += 1
                continue
        example.source = where
        dataset.examples.append(example)
    if errors and data.on_bad_row == "skip":
        dataset.skipped, errors = len(errors), []
    if not errors and not dataset.examples:
        errors.append(f"{file}: no samples to train on ({dataset.skipped} bad rows skipped, "
                      f"{dataset.dropped} with nothing trained within max_len)")
    if len(errors) > MAX_ERRORS_SHOWN:
        errors = errors[:MAX_ERRORS_SHOWN] + [f"... and {len(errors) - MAX_ERRORS_SHOWN} more"]
    if errors:
        raise DataError(errors)
    return dataset


def steps_per_epoch(samples: int, batch_size: int) -> int:
    """Optimizer steps in one pass over ``samples`` (the last batch may be smaller)."""
    return math.ceil(samples / batch_size)


def batch_indices(samples: int, batch_size: int, step: int, seed: int, shuffle: bool) -> tuple[int, list[int]]:
    """``(epoch, sample indices)`` of optimizer step ``step`` (0-based): epochs are consecutive passes,
    each in the order of ``random.Random(seed + epoch)`` when ``shuffle`` (a function of the step alone,
    so a resumed run continues with the same batches)."""
    per_epoch = steps_per_epoch(samples, batch_size)
    epoch, within = divmod(step, per_epoch)
    order = list(range(samples))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return epoch, order[within * batch_size:(within + 1) * batch_size]


def to_batch(examples: list[SFTExample]) -> Any:
    """A :class:`~posttrain.core.train_batch.TrainBatch`: ``tokens [B, T]`` right-padded, ``lengths [B]``,
    ``response_mask [B, T]`` the loss mask and ``advantages [B, T]`` equal to it (the SFT loss ignores
    them; the trainer's interface is the RL one). The trainer backend packs each micro-batch into one
    row (Megatron: THD with ``cu_seqlens``, no attention across samples, no padding computed)."""
    import torch

    from posttrain.core.train_batch import TrainBatch

    width = max(len(e.tokens) for e in examples)
    tokens = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros(len(examples), width)
    for i, e in enumerate(examples):
        tokens[i, :len(e.tokens)] = torch.tensor(e.tokens)
        mask[i, :len(e.mask)] = torch.tensor(e.mask, dtype=torch.float32)
    lengths = torch.tensor([len(e.tokens) for e in examples])
    return TrainBatch(tokens=tokens, lengths=lengths, response_mask=mask, advantages=mask.clone())
