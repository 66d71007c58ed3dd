"""Reward `keyword`: fraction of required keywords present in the response."""

from dataclasses import dataclass, field

from posttrain import hookimpl, option
from posttrain.api import Component


class KeywordReward(Component):
    """Fraction of ``keywords`` (from the config, plus ``metadata["keywords"]``) found in the response.

    ``score = |{k : k in response}| / |keywords|``; 0.0 when there are no keywords.
    """

    name = "keyword"
    scope = "sample"

    @dataclass
    class Config:
        keywords: list[str] = field(default_factory=list)
        ignore_case: bool = option(True, help="match case-insensitively")

    def __call__(self, sample):
        words = list(self.config.keywords) + list(sample.metadata.get("keywords", []))
        if not words:
            return {"score": 0.0}
        text = sample.response.lower() if self.config.ignore_case else sample.response
        hits = sum((w.lower() if self.config.ignore_case else w) in text for w in words)
        return {"score": hits / len(words), "hits": float(hits)}


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(KeywordReward)
