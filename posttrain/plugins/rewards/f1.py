"""SQuAD token F1 between the response and the label (or the best of several labels)."""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Component
from posttrain.core.types import Sample

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_tokens(text: str) -> list[str]:
    """SQuAD normalization: lower-case, drop punctuation and articles, split on whitespace."""
    return _ARTICLES.sub(" ", str(text).lower().translate(_PUNCT)).split()


def token_f1(prediction: str, reference: str) -> float:
    """``2PR / (P + R)`` over the multiset of normalized tokens; 1.0 when both are empty."""
    pred, ref = normalize_tokens(prediction), normalize_tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


class F1(Component):
    """SQuAD-style token F1 in [0, 1]; a list label scores against its best element.

    With ``think_end`` set, only the text after its last occurrence counts.
    """

    name = "f1"
    scope = "sample"

    @dataclass
    class Config:
        think_end: str | None = option("</think>", help="score only the text after this marker")

    def __call__(self, sample: Sample) -> float:
        if sample.label is None:
            raise ValueError("f1 needs a label")
        text = sample.response
        if self.config.think_end and self.config.think_end in text:
            text = text.rsplit(self.config.think_end, 1)[1]
        labels = sample.label if isinstance(sample.label, (list, tuple)) else [sample.label]
        return max(token_f1(text, str(label)) for label in labels)


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(F1)
