"""A router served by uvicorn on a thread of the test process, on a loopback port."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import uvicorn

from kvpilot.ports import free_port
from kvpilot.router.app import create_app
from kvpilot.router.config import RouterConfig
from kvpilot.router.wake import WakeHook
from tests.server.conftest import LiveServer


class RouterThread:
    """``create_app(config, wake=wake)`` served by uvicorn on a thread; ``url`` is its base
    address, ``state`` its ``Router``."""

    def __init__(self, config: RouterConfig, wake: WakeHook | None = None) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.app = create_app(config, wake=wake)
        self.state = self.app.state.router
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the router did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    metrics = LiveServer.metrics  # reads ``self.url``'s /metrics

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


@contextlib.contextmanager
def live_replicas(*flag_sets: Sequence[str]) -> Iterator[list[LiveServer]]:
    """One ``kvpilot serve`` per flag set, started together, ready, stopped on exit."""
    servers = [LiveServer(*flags) for flags in flag_sets]
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()
