"""The text of the local engine's answers: ``tokenizer.decode(output_ids)``, as SGLang's ``text``.

The engine decodes in its own thread, between two steps, so the decoding is part of the step's tail when many
answers end together (an RL batch whose rows all reach ``max_new_tokens`` ends in one step: 512 answers of 512
tokens). :class:`AnswerTexts` decodes the answers of one step in one call of the tokenizer's Rust backend
(``decode_batch``, which spreads the rows over the cores) where that gives ``decode``'s text exactly: a fast
tokenizer with no clean-up of tokenization spaces (a Hugging Face fast tokenizer's ``decode`` is then the
backend's ``decode`` of the same ids). Otherwise, row by row through ``decode``. Answers of up to two tokens are
remembered (a quickstart's one-token answers come back thousands of times a step).
"""

from __future__ import annotations

from typing import Any

SHORT = 2  # answers of at most this many tokens are remembered
REMEMBERED = 65536  # remembered texts, at most (cleared when full)


class AnswerTexts:
    """``decode(ids, skip_special_tokens)`` and ``decode_many(rows, skip_special_tokens)`` for ``tokenizer``
    (a Hugging Face tokenizer: anything with ``decode``)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = backend if backend is not None and hasattr(backend, "decode_batch") and \
            not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None
        self._short: dict[tuple, str] = {}

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if len(ids) > SHORT:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        key = (skip_special_tokens, *ids)
        text = self._short.get(key)
        if text is None:
            if len(self._short) >= REMEMBERED:
                self._short.clear()
            text = self._short[key] = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def decode_many(self, rows: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """The texts of ``rows``, each what :meth:`decode` gives it; the long ones in one backend call."""
        texts: list[str | None] = [None] * len(rows)
        long_rows = [i for i, ids in enumerate(rows) if len(ids) > SHORT]
        if self.backend is not None and len(long_rows) > 1:
            decoded = self.backend.decode_batch([list(rows[i]) for i in long_rows],
                                                skip_special_tokens=skip_special_tokens)
            for i, text in zip(long_rows, decoded):
                texts[i] = text
        return [self.decode(ids, skip_special_tokens) if text is None else text for ids, text in zip(rows, texts)]
