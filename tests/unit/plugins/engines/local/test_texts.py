"""The local engine's answer texts (``posttrain.plugins.engines.local.texts``): one backend call for a step's
answers gives exactly what ``tokenizer.decode`` gives each, and tokenizers it cannot serve that way decode row
by row; through the engine, answers that end in the same step carry the same texts."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from posttrain.plugins.engines.local.texts import AnswerTexts
from posttrain.testing.tiny import make_tokenizer


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("char")
    make_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE (Qwen's and GPT-2's kind) trained here on a few sentences, with special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The answer is 42.", "Let x = 3; then 2x + 1 = 7 , so x is odd !", "日本語 と émigré café"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def _rows(vocab: int, special: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    rows = [[], [special[0]], [5, special[-1]]]  # empty, one token, two tokens (the remembered ones)
    for length in (3, 17, 512, 512, 100):
        row = [rng.randrange(vocab) for _ in range(length)]
        row[length // 2] = special[-1]  # a special token inside
        rows.append(row)
    return rows


@pytest.mark.parametrize("skip", [True, False])
def test_one_backend_call_gives_each_rows_decode(char_tokenizer, byte_bpe, skip):
    for tok in (char_tokenizer, byte_bpe):
        texts = AnswerTexts(tok)
        assert texts.backend is not None  # both fast, without clean-up: one backend call
        rows = _rows(len(tok), tok.all_special_ids)
        assert texts.decode_many(rows, skip) == [tok.decode(r, skip_special_tokens=skip) for r in rows]
        assert [texts.decode(r, skip) for r in rows] == [tok.decode(r, skip_special_tokens=skip) for r in rows]


def test_a_tokenizer_that_cleans_up_spaces_decodes_row_by_row(byte_bpe, monkeypatch):
    calls = []
    backend = byte_bpe.backend_tokenizer
    monkeypatch.setattr(byte_bpe, "clean_up_tokenization_spaces", True)
    texts = AnswerTexts(byte_bpe)
    assert texts.backend is None  # decode would clean up what decode_batch leaves: not the same text
    original = byte_bpe.decode
    monkeypatch.setattr(byte_bpe, "decode", lambda ids, **kw: calls.append(len(ids)) or original(ids, **kw))
    rows = _rows(len(byte_bpe), byte_bpe.all_special_ids, seed=1)
    assert texts.decode_many(rows, True) == [original(r, skip_special_tokens=True) for r in rows]
    assert len(calls) == len(rows) and backend is byte_bpe.backend_tokenizer


def test_a_tokenizer_without_a_backend_decodes_row_by_row():
    class Plain:  # a slow tokenizer's interface: decode only
        def decode(self, ids, skip_special_tokens=False):
            return "|".join(str(i) for i in ids if not (skip_special_tokens and i == 0))

    texts = AnswerTexts(Plain())
    assert texts.backend is None
    assert texts.decode_many([[1, 0, 2], [3], []], True) == ["1|2", "3", ""]


@pytest.mark.parametrize("overlap", [False, True])
def test_answers_that_end_in_one_step_get_the_tokenizers_text(tiny_ckpt, overlap):
    import threading

    from posttrain.plugins.engines.local.engine import BatchEngine
    from posttrain.plugins.engines.local.model_runner import ModelRunner
    from posttrain.plugins.engines.local.sampling import parse_sampling

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    engine = BatchEngine(ModelRunner(tiny_ckpt, max_slots=8), tokenizer=tok, eos_token_ids=[], overlap=overlap)
    batched, real = [], engine.texts.decode_many
    engine.texts.decode_many = lambda rows, skip: batched.append(len(rows)) or real(rows, skip)
    outs, done = [None] * 6, threading.Semaphore(0)

    def on_done(i):
        def f(out):
            outs[i] = out
            done.release()
        return f

    try:
        engine.pause(mode="in_place")  # all six admitted in one prefill: they end in one step
        engine.submit_many([([5 + i, 6, 7], parse_sampling({"max_new_tokens": 9, "temperature": 0,
                                                             "skip_special_tokens": i % 2 == 0}), on_done(i), None, -1)
                            for i in range(6)], return_logprob=True)
        engine.resume()
        for _ in outs:
            assert done.acquire(timeout=60)
    finally:
        engine.shutdown()
    assert sorted(batched) == [3, 3]  # one call per skip_special_tokens value
    for i, out in enumerate(outs):
        assert len(out["output_ids"]) == 9
        assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=i % 2 == 0)
