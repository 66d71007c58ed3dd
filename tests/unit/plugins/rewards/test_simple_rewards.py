"""f1, choice, regex, overlong, length, exact_match: tables of accepted and rejected inputs."""

import pytest

from posttrain.core.config import load_config
from posttrain.core.errors import ConfigError
from posttrain.core.plugins import load_plugins
from posttrain.core.types import Sample

PLUGINS = load_plugins()


def make(name, **config):
    cls = PLUGINS.rewards[name]
    return cls(cls.Config(**config))


def s(response, label=None, metadata=None, length=0):
    return Sample(prompt="q", response=response, label=label, metadata=metadata or {}, response_length=length)


@pytest.mark.parametrize("response,label,expected", [
    ("Paris", "Paris", 1.0),
    ("the Paris.", "paris", 1.0),
    ("Paris France", "Paris", 2 / 3),
    ("London", "Paris", 0.0),
    ("an old man", ["a young man", "old man"], 1.0),
    ("big red dog", "red dog", 0.8),
    ("<think>Paris</think> London", "Paris", 0.0),
    ("", "", 1.0),
])
def test_f1(response, label, expected):
    assert make("f1")(s(response, label)) == pytest.approx(expected)


OPTS = {"choices": ["red", "green", "blue", "yellow"]}


@pytest.mark.parametrize("response,label,metadata,expected", [
    (r"\boxed{B}", "B", OPTS, 1.0),
    ("The answer is (C).", "C", OPTS, 1.0),
    ("Answer: d", "D", OPTS, 0.0),  # lower-case letters are words, not choices
    ("I pick A", 0, OPTS, 1.0),
    ("Answer: B", "green", OPTS, 1.0),
    ("It must be blue", "C", OPTS, 1.0),
    ("(A) is tempting but (B) is right", "B", OPTS, 1.0),
    ("(E)", "A", OPTS, 0.0),  # E is not a valid letter with four options
    ("Answer: B", "A", {}, 0.0),
    ("<think>A? </think>Answer: C", "C", OPTS, 1.0),
    ("no idea", "A", OPTS, 0.0),
])
def test_choice(response, label, metadata, expected):
    assert make("choice")(s(response, label, metadata))["score"] == expected


def test_choice_format_ok_and_bad_label():
    assert make("choice")(s("no idea", "A", OPTS))["format_ok"] == 0.0
    with pytest.raises(ValueError, match="not a letter"):
        make("choice")(s("A", "purple", OPTS))


@pytest.mark.parametrize("pattern,full,response,expected", [
    (r"<think>.*</think>", False, "<think>a\nb</think> 4", 1.0),
    (r"<think>.*</think>", False, "4", 0.0),
    (r"<think>.*</think>\s*\S+", True, "<think>x</think> 4", 1.0),
    (r"<think>.*</think>", True, "<think>x</think> 4", 0.0),
])
def test_regex(pattern, full, response, expected):
    assert make("regex", pattern=pattern, full_match=full)(s(response)) == expected


@pytest.mark.parametrize("length,expected", [(0, 0.0), (3584, 0.0), (3585, -1 / 512), (3840, -0.5),
                                             (4096, -1.0), (5000, -1.0)])
def test_overlong(length, expected):
    assert make("overlong", max_len=4096, buffer=512)(s("x", length=length)) == pytest.approx(expected)


@pytest.mark.parametrize("length,expected", [(0, 0.0), (10, 0.0), (110, -0.1), (10_000, -0.5)])
def test_length(length, expected):
    assert make("length", per_token=0.001, free_tokens=10, max_penalty=0.5)(s("x", length=length)) \
        == pytest.approx(expected)


@pytest.mark.parametrize("response,label,expected", [("  4 ", "4", 1.0), ("4.0", "4", 0.0), ("a  b", "a b", 1.0)])
def test_exact_match(response, label, expected):
    assert make("exact_match")(s(response, label))["score"] == expected


def test_bad_reward_configs_are_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config(None, plugins=PLUGINS, data={"estimator": "grpo", "rewards": [
            {"name": "regex", "pattern": "(unclosed"}, {"name": "overlong", "max_len": 10, "buffer": 20},
            {"name": "length", "per_token": -1}]})
    text = str(info.value)
    assert "rewards.0.pattern: invalid regular expression" in text
    assert "rewards.1.buffer: 20 exceeds max_len 10" in text
    assert "rewards.2.per_token" in text
