"""The agent endpoint: an OpenAI-compatible HTTP server on 127.0.0.1, one path prefix per sample.

``http://127.0.0.1:PORT/s/<session>/v1`` serves ``POST /chat/completions`` (``stream: true`` answers with the
whole message in one chunk), ``POST /completions`` and ``GET /models`` for one sample's
:class:`~.session.Session`. Every request must carry ``Authorization: Bearer <the run's key>``; errors are
OpenAI-style ``{"error": {"message", "type", "code"}}`` bodies, so OpenAI clients raise them as API errors.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from aiohttp import web

from posttrain.plugins.generators.openai_agent.session import RequestError, Session, stream_chunks


log = logging.getLogger("posttrain.openai_agent")


def _error(status: int, message: str) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class AgentEndpoint:
    """The server and its sessions; :meth:`start` in the event loop the generator runs in."""

    def __init__(self, api_key: str):
        self.api_key = api_key
        self.sessions: dict[str, Session] = {}
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> AgentEndpoint:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        app.router.add_post("/s/{sid}/v1/chat/completions", self._chat)
        app.router.add_post("/s/{sid}/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, session: Session) -> str:
        """Register ``session``; return its base URL."""
        sid = secrets.token_hex(8)
        self.sessions[sid] = session
        session.sid = sid
        return f"http://127.0.0.1:{self.port}/s/{sid}/v1"

    def close(self, session: Session) -> None:
        session.closed = True
        self.sessions.pop(session.sid, None)

    def _session(self, request: web.Request) -> Session:
        if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
            raise RequestError(401, "invalid or missing API key (Authorization: Bearer <key>)")
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            raise RequestError(404, "unknown or finished conversation")
        return session

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        return body

    async def _models(self, request: web.Request) -> web.Response:
        try:
            session = self._session(request)
        except RequestError as exc:
            return _error(exc.status, str(exc))
        return web.json_response({"object": "list", "data": [{"id": session.config.model_name, "object": "model",
                                                              "created": 0, "owned_by": "posttrain"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            body = await self._body(request)
            response = await session.chat(body)
        except RequestError as exc:
            return _error(exc.status, str(exc))
        except Exception as exc:  # a template that cannot render these messages, ...: the agent sees why
            log.warning("chat request failed: %s: %s", type(exc).__name__, exc)
            return _error(500, f"{type(exc).__name__}: {exc}")
        if not body.get("stream"):
            return web.json_response(response)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        for chunk in stream_chunks(response):
            await stream.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    async def _completions(self, request: web.Request) -> web.Response:
        try:
            session = self._session(request)
            return web.json_response(await session.complete(await self._body(request)))
        except RequestError as exc:
            return _error(exc.status, str(exc))
        except Exception as exc:
            log.warning("completions request failed: %s: %s", type(exc).__name__, exc)
            return _error(500, f"{type(exc).__name__}: {exc}")
