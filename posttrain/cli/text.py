"""Docstrings and help strings as terminal text.

Components document themselves in reStructuredText (``code``, :class:`~pkg.Name`) and in maths with
brackets (``clip to [low, high]``). Handed to rich as strings, the brackets were read as markup and
vanished, and the backticks showed as they are. Everything user-written goes through here: it becomes a
``rich.text.Text`` (never parsed as markup) with inline code shown in a colour, not in backticks.
"""

from __future__ import annotations

import re

from rich.text import Text

# :class:`~a.b.Name` / :func:`name` / :mod:`a.b` -> the name as shown by Sphinx (last part after ~)
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_CODE = re.compile(r"``(.+?)``")
CODE_STYLE = "cyan"


def _role(m: re.Match) -> str:
    target = m[2]
    return f"``{target.rsplit('.', 1)[-1] if m[1] else target}``"


def plain(text: str) -> str:
    """``text`` without reST inline markup: ``x`` -> x, :class:`~a.B` -> B."""
    return _CODE.sub(r"\1", _ROLE.sub(_role, text or ""))


def rich_text(text: str) -> Text:
    """``text`` as a rich ``Text``: brackets kept literally, inline code coloured instead of backticked."""
    text = _ROLE.sub(_role, text or "")
    out, pos = Text(), 0
    for m in _CODE.finditer(text):
        out.append(text[pos:m.start()])
        out.append(m[1], style=CODE_STYLE)
        pos = m.end()
    out.append(text[pos:])
    return out
