"""The ``search`` tool: keyword search over a local corpus (no network).

The corpus is a JSONL file of ``{"title": ..., "text": ...}`` rows named by ``$POSTTRAIN_SEARCH_CORPUS``,
or the small built-in corpus below. Ranking: number of distinct query words found in title + text
(ties by order in the file); returns the top ``k`` as ``title: text`` lines.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache

from posttrain import hookimpl

BUILTIN_CORPUS = [
    {"title": "Paris", "text": "Paris is the capital of France. It lies on the Seine."},
    {"title": "Berlin", "text": "Berlin is the capital of Germany. Its population is about 3.7 million."},
    {"title": "Mount Everest", "text": "Mount Everest is 8849 metres high, the highest mountain on Earth."},
    {"title": "Nile", "text": "The Nile is about 6650 km long and flows into the Mediterranean Sea."},
    {"title": "Python", "text": "Python is a programming language created by Guido van Rossum in 1991."},
]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


@lru_cache(maxsize=4)
def load_corpus(path: str | None) -> tuple[dict, ...]:
    if not path:
        return tuple(BUILTIN_CORPUS)
    with open(path, encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def search_corpus(query: str, corpus, k: int = 3) -> str:
    words = _words(query)
    scored = [(len(words & _words(d.get("title", "") + " " + d.get("text", ""))), -i, d) for i, d in enumerate(corpus)]
    hits = [d for score, _, d in sorted(scored, key=lambda x: x[:2], reverse=True) if score > 0][:k]
    return "\n".join(f"{d.get('title', '')}: {d.get('text', '')}" for d in hits) or "no results"


def search(query: str, k: int = 3) -> str:
    """Search the local corpus for ``query``; the ``k`` best passages, one per line."""
    if not isinstance(query, str) or not query.strip():
        raise ValueError("query must be a non-empty string")
    return search_corpus(query, load_corpus(os.environ.get("POSTTRAIN_SEARCH_CORPUS")), int(k))


@hookimpl
def posttrain_register_tools(registry):
    registry.add(search, name="search")
