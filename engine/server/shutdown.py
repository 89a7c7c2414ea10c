"""A bounded drain at shutdown: ``kvpilot serve --shutdown-timeout SECONDS`` (vLLM's flag).

On SIGTERM or Ctrl-C uvicorn stops accepting connections and waits for the requests in flight
(its graceful shutdown), then the app's lifespan stops the engine. Without a limit that wait
lasts as long as the longest generation. With one, :class:`DrainingServer` aborts every request
still in flight once the timeout has passed (``AsyncLLM.abort_all``): a stream ends with a 503
error event and ``[DONE]``, any other request with a 503 answer, and their connections close.
uvicorn's own ``timeout_graceful_shutdown`` stays behind it as a backstop (it cancels the
handlers, each with a traceback in the log).

Ctrl-C works the same way, with a second Ctrl-C during the drain ending it at once: the requests in
flight are aborted as if the timeout had passed and the engine still stops cleanly. Only a third
Ctrl-C is uvicorn's force quit (no engine shutdown, the handlers cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable

import uvicorn

logger = logging.getLogger(__name__)

BACKSTOP_SECONDS = 5.0
"""How long after the abort uvicorn itself cancels the handlers that are still running."""

MESSAGE = "the server is shutting down: --shutdown-timeout passed before the request finished"
INTERRUPTED_MESSAGE = "the server is shutting down: interrupted twice before the request finished"


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose graceful shutdown waits at most ``shutdown_timeout`` seconds.

    Args:
        config: uvicorn's configuration (its ``timeout_graceful_shutdown`` is set here).
        shutdown_timeout: seconds to wait for the requests in flight before aborting them
            (0: abort at once); None waits for every one, as uvicorn does.
        abort_all: aborts every request in flight with the message given and returns how many
            (the app's ``app.state.abort_all``, ``AsyncLLM.abort_all``).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        shutdown_timeout: float | None,
        abort_all: Callable[[str], Awaitable[int]],
    ) -> None:
        if shutdown_timeout is not None:
            config.timeout_graceful_shutdown = shutdown_timeout + BACKSTOP_SECONDS
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.abort_all = abort_all
        self._abort: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.interrupted = False  # a Ctrl-C (SIGINT) arrived
        self._interrupted_again = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's serve, remembering its event loop for the signal handler."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: object) -> None:
        """A second Ctrl-C aborts the requests in flight; other signals are uvicorn's."""
        self.interrupted = self.interrupted or sig == signal.SIGINT
        if (
            sig == signal.SIGINT
            and self.should_exit
            and not self._interrupted_again
            and self._loop is not None
        ):
            self._interrupted_again = True
            self._loop.call_soon_threadsafe(
                self._start_abort, INTERRUPTED_MESSAGE, "interrupted twice"
            )
            return
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, with the requests still in flight aborted after the timeout."""
        timer = None
        if self.shutdown_timeout is not None:
            timer = asyncio.get_running_loop().call_later(
                self.shutdown_timeout,
                self._start_abort,
                MESSAGE,
                f"--shutdown-timeout ({self.shutdown_timeout:g} s) passed",
            )
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    def _start_abort(self, message: str, why: str) -> None:
        """On the server's loop: abort the requests in flight (``why`` goes to the log)."""
        self._abort = asyncio.get_running_loop().create_task(self._abort_in_flight(message, why))

    async def _abort_in_flight(self, message: str, why: str) -> None:
        aborted = await self.abort_all(message)
        if aborted:
            logger.warning("%s: aborted %d requests in flight", why, aborted)
