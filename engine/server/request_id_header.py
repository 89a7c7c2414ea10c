"""vLLM's ``--enable-request-id-headers``: every response carries an ``X-Request-Id`` header,
the request's own when it sent one, else a fresh uuid4 (hex), so that a client or a proxy can
match logs to responses."""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"


class RequestIdHeaderMiddleware:
    """Adds ``X-Request-Id`` to every HTTP response (an ASGI middleware).

    Args:
        app: the application it wraps.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get(HEADER) or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
