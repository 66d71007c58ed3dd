"""Multiple choice: the letter the response picks against the label (a letter, an index or the option text)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from posttrain import hookimpl, option
from posttrain.api import Component
from posttrain.core.types import Sample


class Choice(Component):
    r"""1.0 when the chosen letter equals the label's letter, else 0.0; ``format_ok`` says a letter was found.

    The choice is read, in order, from the last ``\boxed{X}``, the last ``answer (is)?: (X)``, the last
    ``(X)`` and the last standalone capital letter among the valid ones; when none is found and the
    options are in ``metadata[choices_key]`` (a list of texts), the response's final line is matched
    against the option texts. The label may be a letter, a 0-based index or one option's text.
    Letters are ``A``... up to the number of options (or ``max_choices`` without options).
    """

    name = "choice"
    scope = "sample"

    @dataclass
    class Config:
        choices_key: str = option("choices", help="metadata key holding the option texts")
        max_choices: int = option(10, ge=2, le=26, help="letters allowed when metadata has no options")
        think_end: str | None = option("</think>", help="score only the text after this marker")

    def _letters(self, options: list | None) -> str:
        n = len(options) if options else self.config.max_choices
        return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]

    def pick(self, text: str, options: list | None) -> str | None:
        letters = self._letters(options)
        cls = f"[{letters}]"
        for pattern in (rf"\\boxed\{{\s*\(?({cls})\)?\s*\}}", rf"(?i:answer)\s*(?:is)?\s*[:=]?\s*\(?({cls})\b\)?",
                        rf"\(({cls})\)", rf"(?<![A-Za-z])({cls})(?![A-Za-z])"):
            found = re.findall(pattern, text)
            if found:
                return found[-1]
        if options:
            lines = [line.strip().rstrip(".").lower() for line in text.strip().splitlines() if line.strip()]
            if lines:
                for i, opt in enumerate(options):
                    if lines[-1].endswith(str(opt).strip().rstrip(".").lower()):
                        return letters[i]
        return None

    def label_letter(self, label, options: list | None) -> str:
        letters = self._letters(options)
        if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(letters):
            return letters[label]
        text = str(label).strip().strip("()")
        if len(text) == 1 and text.upper() in letters:
            return text.upper()
        if options:
            for i, opt in enumerate(options):
                if str(opt).strip().lower() == text.lower():
                    return letters[i]
        raise ValueError(f"choice label {label!r} is not a letter in {letters}, an index, or one of the options")

    @staticmethod
    def contract_cases() -> list[tuple[Sample, float]]:
        """Cases for the reward contract."""
        meta = {"choices": ["red", "green", "blue"]}
        return [(Sample(prompt="Pick", response="Answer: (B)", label="B", metadata=meta), 1.0),
                (Sample(prompt="Pick", response=r"\boxed{C}", label="green", metadata=meta), 0.0),
                (Sample(prompt="Pick", response="blue", label=2, metadata=meta), 1.0)]

    def __call__(self, sample: Sample) -> dict[str, float]:
        options = (sample.metadata or {}).get(self.config.choices_key)
        if options is not None and not isinstance(options, (list, tuple)):
            raise ValueError(f"metadata[{self.config.choices_key!r}] must be a list of option texts")
        gold = self.label_letter(sample.label, options)
        text = sample.response
        if self.config.think_end and self.config.think_end in text:
            text = text.rsplit(self.config.think_end, 1)[1]
        got = self.pick(text, options)
        return {"score": float(got == gold), "format_ok": float(got is not None)}


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(Choice)
