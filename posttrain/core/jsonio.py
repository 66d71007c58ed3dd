"""JSON for the rollout protocol's hot path (``/generate`` bodies and answers): orjson when installed
(several times faster at encoding and decoding the thousand-row answers of a batched ``/generate``), else
the standard library. Both give the same values back (floats round-trip exactly); orjson writes NaN and
infinities as ``null`` where ``json`` writes the non-standard ``NaN``/``Infinity``, and :func:`loads`
reads whatever ``json`` reads. Requests keep the standard library's encoder (they are small, and a NaN or
an int beyond 64 bits must reach the server as written, to be refused there); a large request whose
floats are known to be finite can be encoded once with :func:`dumps_finite` and sent as it is."""

from __future__ import annotations

import json
import math
from typing import Any

try:
    import orjson
except ImportError:  # optional: not a dependency
    orjson = None


def dumps_bytes(obj: Any) -> bytes:
    """``obj`` as UTF-8 JSON bytes (what an HTTP body carries)."""
    return orjson.dumps(obj) if orjson is not None else json.dumps(obj).encode()


def dumps_finite(obj: Any) -> bytes:
    """``obj`` as UTF-8 JSON bytes, for a caller that knows every float in it is finite: orjson when it
    can write it exactly (else, e.g. an int beyond 64 bits, the standard library, which writes it as
    given)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except orjson.JSONEncodeError:
            pass
    return json.dumps(obj).encode()


def finite(obj: Any) -> bool:
    """No NaN or infinity anywhere in ``obj`` (nested dicts, lists and tuples)."""
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(finite(v) for v in obj)
    return True


def loads(data: str | bytes | bytearray) -> Any:
    """The value of JSON text ``data``; raises ``json.JSONDecodeError`` (a ``ValueError``) if malformed.
    What orjson refuses goes to ``json`` (which also reads ``NaN``/``Infinity``), so both accept the same."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)
