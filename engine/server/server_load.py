"""vLLM's server load tracking (``--enable-server-load-tracking``): the number of requests in
flight on the routes that run the model, read back as ``GET /load`` -> ``{"server_load": N}``.

A tracked request counts from when its handler starts (its body already parsed and checked)
until its response has been sent in full, or the handler failed, or the client went away; a
stream counts until its last event. Without the flag nothing is counted and ``/load`` answers
``{"server_load": 0}``, as vLLM's does.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

P = ParamSpec("P")


class ServerLoad:
    """The in-flight count of the tracked routes (vLLM's ``app.state.server_load_metrics``).

    Args:
        enabled: count (vLLM's ``--enable-server-load-tracking``); off, ``in_flight`` stays 0.

    Attributes:
        in_flight: requests whose tracked handler has started and whose response has not been
            sent in full yet.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight = 0

    def track(self, handler: Callable[P, Awaitable[Any]]) -> Callable[P, Awaitable[Any]]:
        """``handler`` (a route's function) counted while it runs and its response is sent
        (vLLM's ``load_aware_call``); FastAPI reads the wrapper's signature as ``handler``'s.

        A ``Response`` the handler returns is released once it has been sent (or its sending
        failed, or the client went away); any other value, or an exception, at once.
        """
        if not self.enabled:
            return handler

        @functools.wraps(handler)
        async def tracked(*args: P.args, **kwargs: P.kwargs) -> Any:
            self.in_flight += 1
            try:
                result = await handler(*args, **kwargs)
            except BaseException:
                self.in_flight -= 1
                raise
            if isinstance(result, Response):
                return _ReleasedWhenSent(result, self._release)
            self.in_flight -= 1
            return result

        return tracked

    def _release(self) -> None:
        self.in_flight -= 1


class _ReleasedWhenSent(Response):
    """``response`` sent unchanged, then ``release()`` however the sending ended. Attributes
    the wrapper lacks (``status_code``, ``headers`` ...) are read from ``response``."""

    def __init__(self, response: Response, release: Callable[[], None]) -> None:
        # Response.__init__ is not called: the wrapped response is already built.
        self.response = response
        self.release = release
        self.background = None  # FastAPI puts the route's background tasks here

    def __getattr__(self, name: str) -> Any:
        if name == "response":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.response, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()
        if self.background is not None:
            await self.background()
