"""Prompt token ids are encoded once per text and tokenizer (issue 17: an epoch repeats every prompt, a
group's samples share theirs), handed out as fresh lists, and the cache stays bounded."""

from __future__ import annotations

from posttrain.core.rollout import samples
from posttrain.core.types import Sample


class CountingTokenizer:
    def __init__(self):
        self.calls = []

    def encode(self, text, add_special_tokens=False):
        self.calls.append(text)
        return [ord(c) for c in text]


def test_each_text_is_encoded_once_and_every_caller_gets_its_own_list():
    tok = CountingTokenizer()
    first = samples.prompt_ids(Sample(prompt="1+2="), tok)
    first.append(0)  # a caller extending its ids must not change what the next one gets
    again = samples.prompt_ids(Sample(prompt="1+2="), tok)
    assert again == [ord(c) for c in "1+2="] and tok.calls == ["1+2="]
    samples.prompt_ids(Sample(prompt="3+4="), tok)
    assert tok.calls == ["1+2=", "3+4="]
    assert samples.prompt_ids(Sample(prompt="1+2="), CountingTokenizer()) == again  # per tokenizer


def test_the_cache_starts_over_past_its_token_bound(monkeypatch):
    monkeypatch.setattr(samples, "_ENCODED_MAX_TOKENS", 8)
    tok = CountingTokenizer()
    for text in ("abcd", "efgh", "ijkl", "abcd"):  # the third fills it past 8: the first is forgotten
        samples.encode_cached(tok, text)
    assert tok.calls == ["abcd", "efgh", "ijkl", "abcd"]
    samples.encode_cached(tok, "ijkl")
    assert tok.calls[-1] == "abcd", "ijkl was kept after the reset"
