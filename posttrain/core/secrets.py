"""Secrets in a run config (``headers`` of remote rewards, API keys, tokens, passwords) stay out of what a
run writes for others to read: ``config.yaml``, checkpoints, logs and W&B get ``REDACTED`` in their place.

A value is secret when its key names a credential (``api_key``, ``token``, ``secret``, ``password``,
``authorization``, ...) or it sits under a ``headers`` mapping (HTTP headers carry bearer tokens and
cookies). :func:`split` returns the redacted config and the secrets by dotted path; the run directory
keeps the latter in ``secrets.yaml`` (mode 0600) so ``--resume`` gets them back (:func:`merge`).
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"
SECRET_KEY = re.compile(r"(secret|passw(or)?d|api[_-]?key|access[_-]?key|private[_-]?key|credential|authorization"
                        r"|cookie|^token$|^(auth|access|bearer|refresh|hf|id|api)_?token$)", re.IGNORECASE)


def is_secret_key(key: Any) -> bool:
    """A key naming a credential (``api_key_env``, which names where one is, is not one)."""
    return isinstance(key, str) and not key.endswith("_env") and bool(SECRET_KEY.search(key))


def split(config: Any, path: str = "", under_headers: bool = False) -> tuple[Any, dict[str, Any]]:
    """``(config with secrets replaced by REDACTED, {dotted.path: secret value})``."""
    found: dict[str, Any] = {}
    if isinstance(config, dict):
        out = {}
        for key, value in config.items():
            where = f"{path}.{key}" if path else str(key)
            secret = under_headers or is_secret_key(key)
            if secret and isinstance(value, str) and value and value != REDACTED:
                out[key], found[where] = REDACTED, value
            else:
                out[key], more = split(value, where, secret or key == "headers")
                found.update(more)
        return out, found
    if isinstance(config, list):
        out_list = []
        for i, value in enumerate(config):
            item, more = split(value, f"{path}.{i}" if path else str(i), under_headers)
            out_list.append(item)
            found.update(more)
        return out_list, found
    return config, found


def redact(config: Any) -> Any:
    """``config`` with every secret replaced by ``REDACTED``."""
    return split(config)[0]


def merge(config: Any, secrets: dict[str, Any]) -> Any:
    """Put ``secrets`` (from :func:`split`) back where ``config`` has ``REDACTED`` at their paths."""
    for path, value in secrets.items():
        node, parts = config, path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        last = parts[-1]
        if isinstance(node, dict) and node.get(last) == REDACTED:
            node[last] = value
        elif isinstance(node, list) and last.isdigit() and int(last) < len(node) and node[int(last)] == REDACTED:
            node[int(last)] = value
    return config
