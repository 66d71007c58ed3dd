"""Answer extraction and math equivalence shared by the math-like rewards (math-verify underneath).

Kept out of the plugin modules so they stay import-light: ``math_verify`` pulls in sympy (~0.5 s),
imported here lazily inside :func:`math_equal`.
"""

from __future__ import annotations

import functools
import re
import threading

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced; None if absent.

    ``\boxed 5`` (no braces, as some models write) yields ``5``.
    """
    best = None
    for marker in ("\\boxed", "\\fbox"):
        start = text.rfind(marker)
        if start >= 0 and (best is None or start > best[0]):
            best = (start, marker)
    if best is None:
        return None
    i = best[0] + len(best[1])
    if i < len(text) and text[i] == " ":
        m = re.match(r" +([^\s$]+)", text[i:])
        return m.group(1) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
        j += 1
    return None  # unbalanced: the box never closed (truncated response)


def after_marker(text: str, marker: str | None) -> tuple[str, bool]:
    """``(text after the last marker, marker found)``; with no marker configured, ``(text, True)``."""
    if not marker:
        return text, True
    if marker not in text:
        return text, False
    return text.rsplit(marker, 1)[1], True


def extract_answer(text: str, answer_pattern: str | None = None) -> tuple[str | None, str]:
    r"""``(answer, how)``: the last ``\boxed{}``, else the last match of ``answer_pattern`` (its first
    group), else the last number; ``how`` is ``"boxed"``, ``"pattern"``, ``"number"`` or ``"none"``."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    if answer_pattern:
        matches = list(re.finditer(answer_pattern, text))
        if matches:
            m = matches[-1]
            ans = (m.group(1) if m.groups() else m.group(0)).strip().rstrip(".")
            if ans:
                return ans, "pattern"
    numbers = NUMBER.findall(text)
    if numbers:
        return numbers[-1].rstrip(".,"), "number"
    return None, "none"


_PLAIN = re.compile(r"^-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$|^-?\d+/\d+$|^-?\.\d+$")


def _plain_number(text: str):
    """A ``Fraction`` for plain numbers (``12``, ``-0.5``, ``1,000``, ``3/4``); None otherwise."""
    from fractions import Fraction

    t = text.strip().strip("$").strip()
    if not _PLAIN.match(t):
        return None
    try:
        return Fraction(t.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


@functools.lru_cache(maxsize=8192)
def _parse_cached(text: str, timeout: int):
    return tuple(_parse(text, timeout))


def _parse(text: str, timeout: int):
    from math_verify import parse
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    body = text.strip()
    if not (body.startswith("$") or "\\boxed" in body or body.startswith("\\(") or body.startswith("\\[")):
        body = f"${body}$"
    return parse(body, [LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=timeout)


def math_equal(answer: str, label: str, timeout: int = 5) -> bool:
    """Whether ``answer`` equals ``label`` mathematically (math-verify: fractions, decimals, LaTeX,
    sets, intervals, equations ``x = 4`` vs ``4``, units and percent signs normalized).

    math-verify's timeouts use ``SIGALRM``, which only the main thread may set: off the main thread
    they are disabled (the reward runner then relies on its process pool for isolation). Falls back
    to whitespace-insensitive string equality when either side does not parse.
    """
    a, b = _plain_number(answer), _plain_number(str(label))
    if a is not None and b is not None:  # fast path for plain numbers; near misses go to math-verify
        if a == b:
            return True
        if abs(a - b) > 1e-6 * max(1, abs(b)):
            return False
    if threading.current_thread() is not threading.main_thread():
        timeout = 0
    from math_verify import verify

    # parses are cached: a group's samples share one label and often the same answer
    gold, pred = _parse_cached(str(label), timeout), _parse_cached(answer, timeout)
    if gold and pred and verify(list(gold), list(pred), timeout_seconds=timeout or None):
        return True
    return _squash(answer) == _squash(str(label))


def _squash(s: str) -> str:
    return re.sub(r"\s+|\$|\\[!,;: ]", "", s).rstrip(".").lower()
