"""What the local engine server refuses in a request body, shared by its routes (``server``, ``weight_routes``):
the size limits per kind of endpoint and the exceptions its error middleware answers with their status."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from posttrain.core import jsonio

SMALL_BODY_LIMIT = 1 << 20  # control endpoints
GENERATE_BODY_LIMIT = 16 << 20  # a batched /generate of a few hundred long prompts
WEIGHTS_BODY_LIMIT = 1 << 30  # /update_weights_from_tensor carries CPU tensors by value


class BadRequest(Exception):
    """A request the server answers with HTTP 400 and this message; the server goes on serving."""

    status = 400


class TooSlow(BadRequest):
    """A body that did not arrive in time (``request_timeout_s``): HTTP 408, and the connection is closed."""

    status = 408


class TooLarge(BadRequest):
    """A body over its endpoint's limit: HTTP 413, refused before it is held in memory."""

    status = 413



async def read_json(request: web.Request, timeout_s: float, required: bool = True,
                    limit: int = SMALL_BODY_LIMIT) -> dict[str, Any]:
    """The JSON object in the body, read up to ``limit`` bytes (413 beyond: a 1 GiB body to a control endpoint is
    refused before it is held in memory) within ``timeout_s`` (408 after: a client that stalls mid-body does not
    hold its connection); nesting too deep for the parser is a 400 like any malformed body."""
    if request.content_length is not None and request.content_length > limit:
        raise TooLarge(f"request body: {request.content_length} bytes; {request.path} takes at most {limit}")
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_chunked(1 << 16):
                raw += chunk
                if len(raw) > limit:
                    raise TooLarge(f"request body: over {limit} bytes; {request.path} takes at most {limit}")
    except TimeoutError:
        raise TooSlow(f"request body: not received within {timeout_s:g} s ({len(raw)} bytes came)") from None
    if not raw.strip():
        if required:
            raise BadRequest("request body: expected a JSON object, got nothing")
        return {}
    try:
        body = jsonio.loads(raw)
    except RecursionError:
        raise BadRequest("request body: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body: malformed JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body: expected a JSON object, got {type(body).__name__}")
    return body
