"""What the local engine server refuses in a request body, shared by its routes (``server``, ``weight_routes``):
the size limits per kind of endpoint and the exceptions its error middleware answers with their status."""

from __future__ import annotations

SMALL_BODY_LIMIT = 1 << 20  # control endpoints
GENERATE_BODY_LIMIT = 16 << 20  # a batched /generate of a few hundred long prompts
WEIGHTS_BODY_LIMIT = 1 << 30  # /update_weights_from_tensor carries CPU tensors by value


class BadRequest(Exception):
    """A request the server answers with HTTP 400 and this message; the server goes on serving."""

    status = 400


class TooLarge(BadRequest):
    """A body over its endpoint's limit: HTTP 413, refused before it is held in memory."""

    status = 413
