"""The math reward: a table of accepted and rejected answers (math-verify equivalence)."""

import pytest

from posttrain.core.plugins import load_plugins
from posttrain.core.types import Sample

MathReward = load_plugins().rewards["math"]

# (response, label, expected score)
CASES = [
    # fractions, decimals, LaTeX
    (r"The answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{1/2}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{\tfrac{3}{4}}", "3/4", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", 1.0),
    (r"\boxed{3.0}", "3", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{2\pi}", r"2\pi", 1.0),
    (r"\boxed{0.333}", "1/3", 0.0),
    (r"\boxed{-0.5}", "-1/2", 1.0),
    (r"\boxed{2/4}", "0.5", 1.0),
    (r"\boxed{1,001}", "1000", 0.0),
    (r"\boxed{4}", r"\boxed{4}", 1.0),
    (r"\boxed{4}", ["2", "4"], 1.0),
    (r"\boxed{3}", ["2", "4"], 0.0),
    (r"\boxed{}", "0", 0.0),
    (r"\boxed{-2}", "2", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    (r"\boxed{3.14159}", r"\pi", 0.0),
    # sets and intervals
    (r"\boxed{\{2, 1\}}", r"\{1,2\}", 1.0),
    (r"\boxed{(1, 2]}", "(1,2]", 1.0),
    (r"\boxed{(1,2)}", "[1,2]", 0.0),
    (r"\boxed{\{1,3\}}", r"\{1,2\}", 0.0),
    # equations and units
    (r"\boxed{x = 4}", "4", 1.0),
    (r"so x=4, i.e. \boxed{x=4}", "4", 1.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
    (r"\boxed{50^\circ}", "50", 1.0),
    (r"\boxed{10\%}", "10", 1.0),
    (r"\boxed{x = 5}", "4", 0.0),
    # multiple boxes: the last one counts
    (r"First \boxed{3}, but wait, it is \boxed{4}", "4", 1.0),
    (r"First \boxed{4}, but wait, it is \boxed{3}", "4", 0.0),
    (r"nested \boxed{\frac{1}{\sqrt{4}}}", "0.5", 1.0),
    # no box: answer pattern, then the last number
    ("The result follows. Answer: 42", "42", 1.0),
    ("answer is: 7/2", "3.5", 1.0),
    ("We get 12 apples, then 7 remain", "7", 1.0),
    ("We get 12 apples, then 7 remain", "12", 0.0),
    ("no numbers at all", "3", 0.0),
    ("", "3", 0.0),
    # unbalanced box (truncated response): falls back to the last number
    (r"\boxed{\frac{1}{2", "2", 1.0),
    # think_end: only text after </think> counts; no </think> scores 0
    (r"<think>maybe \boxed{5}</think> final: \boxed{6}", "6", 1.0),
    (r"<think>maybe \boxed{5}</think> final: \boxed{6}", "5", 0.0),
    (r"<think>still thinking \boxed{6}", "6", 0.0),
]


@pytest.mark.parametrize("response,label,expected", CASES)
def test_math_table(response, label, expected):
    reward = MathReward(MathReward.Config())
    out = reward(Sample(prompt="q", response=response, label=label))
    assert out["score"] == expected, (response, label, out)


def test_table_is_large_enough():
    assert len(CASES) >= 30
    assert {e for _, _, e in CASES} == {0.0, 1.0}


def test_format_ok_reports_where_the_answer_came_from():
    reward = MathReward(MathReward.Config(think_end=None))
    assert reward(Sample(prompt="q", response=r"\boxed{4}", label="4"))["format_ok"] == 1.0
    assert reward(Sample(prompt="q", response="Answer: 4", label="4"))["format_ok"] == 1.0
    assert reward(Sample(prompt="q", response="so 4", label="4")) == {"score": 1.0, "format_ok": 0.0}
    strict = MathReward(MathReward.Config(think_end=None, strict_format=True))
    assert strict(Sample(prompt="q", response="so 4", label="4"))["score"] == 0.0
    boxed_only = MathReward(MathReward.Config(think_end=None, require_boxed=True))
    assert boxed_only(Sample(prompt="q", response="Answer: 4", label="4")) == {"score": 1.0, "format_ok": 0.0}


def test_no_fallback_and_missing_label():
    reward = MathReward(MathReward.Config(last_number_fallback=False))
    assert reward(Sample(prompt="q", response="</think> it is 4", label="4"))["score"] == 0.0
    with pytest.raises(ValueError, match="label"):
        reward(Sample(prompt="q", response=r"\boxed{4}", label=None))


def test_think_end_disabled_scores_everything():
    reward = MathReward(MathReward.Config(think_end=None))
    assert reward(Sample(prompt="q", response=r"<think>hmm \boxed{6}", label="6"))["score"] == 1.0


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(p=st.integers(-500, 500), q=st.integers(1, 60), style=st.sampled_from(["frac", "slash", "eq", "dec"]))
def test_equivalent_forms_agree_and_off_by_one_does_not(p, q, style):
    from fractions import Fraction

    value = Fraction(p, q)
    forms = {"frac": rf"\frac{{{p}}}{{{q}}}", "slash": f"{p}/{q}", "eq": f"x = {p}/{q}",
             "dec": f"{float(value):.10f}".rstrip("0").rstrip(".")}
    reward = MathReward(MathReward.Config())
    label = f"{value.numerator}/{value.denominator}" if value.denominator != 1 else str(value.numerator)
    response = rf"\boxed{{{forms[style]}}}"
    if style != "dec" or value.denominator in (1, 2, 4, 5, 8, 10, 16, 20, 25, 40, 50):  # exact decimals only
        assert reward(Sample(prompt="q", response=response, label=label))["score"] == 1.0, (response, label)
    wrong = value + 1
    assert reward(Sample(prompt="q", response=response, label=f"{wrong.numerator}/{wrong.denominator}"))["score"] \
        == 0.0


def test_dapo_style_scores():
    reward = MathReward(MathReward.Config(correct_score=1.0, wrong_score=-1.0))
    assert reward(Sample(prompt="q", response=r"\boxed{4}", label="4"))["score"] == 1.0
    assert reward(Sample(prompt="q", response=r"\boxed{5}", label="4"))["score"] == -1.0
    assert reward(Sample(prompt="q", response="<think>never ends", label="4"))["score"] == -1.0
    assert reward(Sample(prompt="q", response="nothing", label="4"))["score"] == -1.0


def test_gsm8k_labels_are_the_number_after_the_marker():
    label = "She sold 48 / 2 = <<48/2=24>>24 clips in May.\nAltogether 48 + 24 = <<48+24=72>>72.\n#### 1,072"
    reward = MathReward()
    assert reward(Sample(prompt="q", response=r"So \boxed{1072}", label=label))["score"] == 1.0
    assert reward(Sample(prompt="q", response=r"\boxed{72}", label=label))["score"] == 0.0
    marked = MathReward(MathReward.Config(label_marker="ANSWER:"))  # any marker: the text after it
    assert marked(Sample(prompt="q", response=r"\boxed{6}", label="2 + 2 = 4, 3 + 3 = 6 ANSWER: 6"))["score"] == 1.0
