r"""Math answers checked for equivalence with math-verify."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Component
from posttrain.core.types import Sample


class MathReward(Component):
    r"""1.0 when the final answer equals the label mathematically, else 0.0 (both configurable).

    The answer is the content of the last ``\boxed{...}``; else the first group of the last match of
    ``answer_pattern`` (default ``answer: ...`` to the end of the line); else the last number in the
    text. Equivalence is decided by math-verify (``1/2`` = ``0.5`` = ``\frac{1}{2}``, ``\{1,2\}`` =
    ``\{2,1\}``, ``(1,2]`` intervals, ``x = 4`` = ``4``, ``5\text{ cm}`` = ``5``). With ``think_end``
    set, only the text after its last occurrence is scored; a response that opened ``think_start``
    but never wrote ``think_end`` scores ``wrong_score`` (the model never finished thinking), and so
    does any response without ``think_end`` when ``require_think_end`` is set.

    A list label accepts any of its elements; a label holding ``label_marker`` (GSM8K's ``answer`` column,
    a worked solution ending ``#### 72``) is the text after its last occurrence. Returns ``{"score": correct_score | wrong_score (1 | 0 by
    default), "format_ok": 0|1}``: ``format_ok`` is 1 when the answer came from a box (or from
    ``answer_pattern`` unless ``require_boxed``), 0 for the last-number fallback. With
    ``strict_format`` a correct answer without ``format_ok`` scores ``wrong_score``.
    """

    name = "math"
    scope = "sample"

    @dataclass
    class Config:
        think_end: str | None = option("</think>", help="score only the text after this marker; null disables")
        think_start: str = option("<think>", help="a response with this but no think_end scores 0")
        require_think_end: bool = option(False, help="a response without think_end scores 0")
        answer_pattern: str | None = option(r"(?i)answer\s*(?:is)?\s*[:=]\s*([^\n]+)",
                                            help="regex (first group = the answer) tried when no \\boxed{} is found")
        require_boxed: bool = option(False, help="format_ok only for \\boxed{} answers")
        strict_format: bool = option(False, help="score 0 unless format_ok")
        last_number_fallback: bool = option(True, help="use the last number when nothing else is found")
        timeout: int = option(5, ge=0, help="math-verify parse/verify timeout in seconds (main thread only)")
        correct_score: float = option(1.0, help="score of a correct answer")
        wrong_score: float = option(0.0, help="score of a wrong or missing answer (DAPO uses -1)")
        label_marker: str | None = option("####", help="a label holding it is the text after its last occurrence "
                                                       "(GSM8K's '... #### 72'); null disables")

    @staticmethod
    def contract_cases() -> list[tuple[Sample, float]]:
        """Cases for the reward contract."""
        return [(Sample(prompt="1/2?", response=r"<think>hm</think> \boxed{\frac{1}{2}}", label="0.5"), 1.0),
                (Sample(prompt="1/2?", response=r"\boxed{0.6}", label="0.5"), 0.0)]

    def warm_up(self) -> None:
        """Import math-verify and sympy now (about a second) rather than on the first sample."""
        from posttrain.plugins.rewards.math.answers import math_equal

        math_equal(r"\frac{1}{2}", r"\{0.5\}")

    def __call__(self, sample: Sample) -> dict[str, float]:
        from posttrain.plugins.rewards.math.answers import after_marker, extract_answer, math_equal

        if sample.label is None:
            raise ValueError("math needs a label (the reference answer)")
        c = self.config
        text, closed = after_marker(sample.response, c.think_end)
        if not closed and (c.require_think_end or c.think_start in sample.response):
            return {"score": c.wrong_score, "format_ok": 0.0}
        answer, how = extract_answer(text, c.answer_pattern)
        if how == "number" and not c.last_number_fallback:
            answer, how = None, "none"
        format_ok = how == "boxed" or (how == "pattern" and not c.require_boxed)
        if answer is None or (c.strict_format and not format_ok):
            return {"score": c.wrong_score, "format_ok": float(format_ok)}
        labels = sample.label if isinstance(sample.label, (list, tuple)) else [sample.label]
        if c.label_marker:
            labels = [str(label).rsplit(c.label_marker, 1)[-1].strip() for label in labels]
        right = any(math_equal(answer, str(label), c.timeout) for label in labels)
        return {"score": c.correct_score if right else c.wrong_score, "format_ok": float(format_ok)}


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(MathReward)
