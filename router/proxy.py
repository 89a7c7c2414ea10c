"""Forwarding one HTTP request to a replica and its answer back, unbuffered.

The request's body and headers go out as they came (hop-by-hop headers aside); the answer's
status, headers and body bytes come back unchanged, chunk by chunk as the replica writes them
(Server-Sent Events included), with no decompression on the way. A client that disconnects,
before the answer starts or during it, has its upstream connection closed at once, which the
engine's server sees as the client's disconnect: it aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and those the transport recomputes.
_REQUEST_DROP = frozenset(
    {"host", "content-length", "connection", "keep-alive", "te", "trailer", "transfer-encoding",
     "upgrade", "proxy-connection"}
)  # fmt: skip
# The router's server writes its own Date and Server.
_RESPONSE_DROP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "trailer", "upgrade", "date", "server"}
)


class UpstreamUnreachable(Exception):
    """The replica failed before answering a byte: the request may go to another one.

    Attributes:
        refused: the connection failed (refused, unreachable, connect timeout, reset or closed
            before an answer): the replica should be routed around for a while. Pooled
            connections idle past 2 s are dropped, before uvicorn's 5 s keep-alive closes them,
            so a live replica is not taken for a dead one by a stale connection.
    """

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


def make_session(connect_timeout_s: float) -> aiohttp.ClientSession:
    """The router's one client session: no overall timeout (streams last as long as they
    last), ``connect_timeout_s`` to connect, no pool limit, bodies passed through compressed or
    not as they come. Idle pooled connections are dropped after 2 s, before uvicorn's 5 s
    keep-alive closes them under a request."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout_s),
        auto_decompress=False,
    )


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's request headers to send upstream (hop-by-hop ones dropped)."""
    return {k: v for k, v in headers.items() if k.lower() not in _REQUEST_DROP}


async def open_upstream(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: Mapping[str, str],
    body: bytes,
) -> aiohttp.ClientResponse:
    """Send the request and wait for the answer's status and headers.

    Returns:
        The open response; its body is not read yet. Close it (``UpstreamResponse`` does).

    Raises:
        UpstreamUnreachable: no byte of an answer came (connection refused or reset, connect
            timeout, the server closed the connection before answering).
    """
    try:
        return await session.request(
            method,
            url,
            data=body,
            headers=forwarded_headers(headers),
            skip_auto_headers=("Accept-Encoding", "Content-Type", "User-Agent"),
        )
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        raise UpstreamUnreachable(f"{url}: {exc!r}", refused=True) from exc
    except aiohttp.ClientResponseError as exc:  # not HTTP: retry, but the replica is alive
        raise UpstreamUnreachable(f"{url}: {exc!r}", refused=False) from exc


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class UpstreamResponse(Response):
    """An ASGI response that relays an open upstream response chunk by chunk.

    Args:
        upstream: the replica's open response (status and headers received).
        on_done: called once when the relay ends, with ``"ok"`` (the whole body relayed),
            ``"disconnect"`` (the client left; upstream closed) or ``"stream"`` (the replica
            broke off mid-body; the client's connection is then cut, never completed).
    """

    def __init__(self, upstream: aiohttp.ClientResponse, on_done: Callable[[str], Any]) -> None:
        self.upstream = upstream
        self.on_done = on_done
        self.status_code = upstream.status
        self.background = None
        self.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in upstream.headers.items()
            if k.lower() not in _RESPONSE_DROP
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "disconnect"
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                outcome = pump.result()
        except OSError:  # the client's socket failed under a write
            outcome = "disconnect"
        finally:
            for task in (pump, watcher):
                task.cancel()
            if outcome == "ok":
                self.upstream.release()
            else:
                self.upstream.close()
            self.on_done(outcome)

    async def _pump(self, send: Send) -> str:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for chunk in self.upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("replica %s broke off a response: %r", self.upstream.url, exc)
            return "stream"
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return "ok"
