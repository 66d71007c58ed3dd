"""The token-in-token-out conformance suite over every chat template posttrain ships for tests, and a planted
template that re-renders earlier turns differently."""

from __future__ import annotations

import pytest

from posttrain.core.rollout.chat import parse_tool_calls
from posttrain.testing.chat_conformance import check_template
from posttrain.testing.chat_templates import PLANTED, TEMPLATES, chat_tokenizer


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_shipped_templates_conform(family):
    assert check_template(chat_tokenizer(family), conversations=24, seed=1, max_calls=TEMPLATES[family][2]) == []


def test_planted_template_is_caught_precisely():
    problems = check_template(chat_tokenizer("qwen3", PLANTED), conversations=6, seed=0)
    assert problems, "a template that drops <think> from earlier turns must fail"
    assert any("does not extend the render after the previous turn" in p and "<think>" in p for p in problems)
    assert any("prefix_breaks" in p for p in problems)


def test_a_parser_that_misreads_calls_is_reported():
    # qwen's tool calls read with llama3's convention: the calls stay text, and the suite says so
    problems = check_template(chat_tokenizer("qwen3"), conversations=4, seed=0, convention="llama_json")
    assert any("parsed back as" in p for p in problems)


@pytest.mark.parametrize("convention,text,content,call", [
    ("hermes", 'hi\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>', "hi", {"a": 1}),
    ("llama_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}<|eom_id|>', "", {"a": 1}),
    ("glm_xml", "ok\n<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "ok", {"a": 1}),
    ("deepseek", 'x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```'
                    '<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>', "x", {"a": 1}),
])
def test_tool_call_conventions(convention, text, content, call):
    assert parse_tool_calls(text, convention) == (content, [{"name": "f", "arguments": call}])


def test_malformed_call_stays_content():
    text = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(text, "hermes") == (text, [])
