"""The API key check (``--api-key``), ahead of everything else a protected request meets.

A plain ASGI middleware rather than a FastAPI dependency: dependencies run after the body has
been read and validated, so a request without a key would learn from a 400 what its body got
wrong before it is told it may not ask at all. Here a request to ``/v1/...`` (or
``/kv_events``, or ``/invocations``, which vLLM leaves open) without ``Authorization: Bearer
<key>`` is answered 401 before its body is read, as vLLM's server does; ``/health``,
``/version`` and ``/metrics`` stay open (probes and Prometheus scrape them without a key).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from http import HTTPStatus

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpilot.engine.server import invocations
from kvpilot.engine.server.anthropic_protocol import error_body as anthropic_error_body
from kvpilot.engine.server.errors import error_response

# Paths (a prefix, or the whole path) that need the key.
PROTECTED_PREFIX = "/v1"
PROTECTED_PATHS = frozenset({"/v1", "/kv_events", invocations.PATH})
ANTHROPIC_PREFIX = "/v1/messages"
"""Anthropic's routes, whose 401 has Anthropic's error body."""


def is_protected(path: str) -> bool:
    """Whether a request to ``path`` needs the API key."""
    return path in PROTECTED_PATHS or path.startswith(PROTECTED_PREFIX + "/")


def api_key(headers: list[tuple[bytes, bytes]]) -> str:
    """The key a request sends: its bearer token, else Anthropic's ``x-api-key`` header (what
    Anthropic's clients send); ``""`` when there is neither."""
    token = bearer_token(headers)
    if token:
        return token
    for name, value in headers:
        if name.lower() == b"x-api-key":
            return value.decode("latin-1").strip()
    return ""


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str:
    """The token of an ``Authorization: Bearer <token>`` header among raw ASGI ``headers``;
    ``""`` when there is none."""
    for name, value in headers:
        if name.lower() == b"authorization":
            text = value.decode("latin-1")
            return text[len("Bearer ") :].strip() if text.startswith("Bearer ") else ""
    return ""


class APIKeyMiddleware:
    """Answers 401 (OpenAI's error body, ``AuthenticationError``) to a protected request whose
    key (``api_key``: the bearer token, or ``x-api-key``) is none of ``api_keys``, each compared
    in constant time.

    Args:
        app: the application it guards.
        api_keys: the keys clients may send (vLLM's ``--api-key`` takes several).
    """

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self.api_keys = [key.encode("utf-8") for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_protected(scope["path"]):
            token = api_key(scope.get("headers", []))
            # latin-1 gives back the header's own bytes; the key is compared as UTF-8 bytes.
            sent = token.encode("latin-1")
            # A list, not a generator: every key is compared, whichever matches.
            if not any([hmac.compare_digest(sent, key) for key in self.api_keys]):
                message = (
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or "
                    "Anthropic's 'x-api-key: <key>')"
                )
                response = error_response(HTTPStatus.UNAUTHORIZED, message)
                if scope["path"].startswith(ANTHROPIC_PREFIX):  # Anthropic's body there
                    status = int(HTTPStatus.UNAUTHORIZED)
                    response = JSONResponse(anthropic_error_body(status, message), status)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
