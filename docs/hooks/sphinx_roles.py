"""Griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): Sphinx roles in docstrings become cross-references.

The package's docstrings are Sphinx-style (``:class:`~posttrain.core.train_batch.TrainBatch```, ``:meth:`run```)
and mkdocstrings' Markdown shows such a role as raw text. Before a docstring is rendered, each role becomes an
optional autoref: a link where the site documents the target (``posttrain.core.interfaces.EstimatorNeeds``), plain
code where it does not (``typing.runtime_checkable``), either way without the role. The text shown is Sphinx's:
the last part of the name after ``~``, the whole name otherwise, ``()`` after a function or method.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?P<role>[a-z]+):`(?P<tilde>~?)(?P<target>[^`<>]+?)`")
CALLABLE = {"func", "meth"}


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: ARG002 (griffe's signature)
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = ROLE.sub(lambda m: autoref(m, obj), obj.docstring.value)


def autoref(match: re.Match, obj: griffe.Object) -> str:
    """The ``<autoref>`` element of one role, its identifier resolved in ``obj``'s scope."""
    target = match["target"].strip()
    shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
    if match["role"] in CALLABLE:
        shown += "()"
    identifier = resolve(target, obj)
    return f'<autoref identifier="{html.escape(identifier)}" optional><code>{html.escape(shown)}</code></autoref>'


def resolve(target: str, obj: griffe.Object) -> str:
    """The full path of ``target`` as the docstring of ``obj`` names it: dotted names as written, a bare name
    a member of ``obj``, of its class or module, or of a parent further up (as written where none has it)."""
    if "." in target:
        return target
    scope: griffe.Object | None = obj
    while scope is not None:
        if target in scope.members:
            return f"{scope.path}.{target}"
        try:
            return scope.resolve(target)
        except (griffe.NameResolutionError, KeyError, AttributeError):
            scope = scope.parent
    return target
