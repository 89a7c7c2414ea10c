"""A live ``kvpilot serve`` process on 127.0.0.1 and helpers to read its ``/metrics``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL
from kvpilot.engine.model_loader import load_tokenizer

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """A ``kvpilot serve`` subprocess; ``url`` is its base address."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "KVPILOT_API_KEY": API_KEY}
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvpilot", "serve", "--port", str(self.port), *args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"kvpilot serve exited with {self.process.returncode}:\n{self.output()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"kvpilot serve not ready after {STARTUP_TIMEOUT_S} s:\n{self.output()}")

    def openai_client(self) -> openai.OpenAI:
        """The official client on this server's ``/v1``, with the test key and no retries."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)

    def output(self, limit: int = 4000) -> str:
        """The end of the server's stdout and stderr."""
        self.log.seek(0)
        return self.log.read()[-limit:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """``/metrics`` parsed with prometheus_client: ``{(sample name, labels): value}``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value; ``model_name`` defaults to the served model."""
        labels.setdefault("model_name", MODEL)
        return self.metrics()[(name, tuple(sorted(labels.items())))]

    def wait_for(self, condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Poll until ``condition()`` holds (the server updates metrics asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached before the deadline")
            time.sleep(0.1)


@pytest.fixture(scope="session")
def api_key() -> str:
    """The key every test server requires (given through ``KVPILOT_API_KEY``)."""
    return API_KEY


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    """The default model's tokenizer, for the test's side (never shared with a server)."""
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[..., LiveServer]]:
    """Factory: ``start_server(*flags)`` starts ``kvpilot serve`` and waits for /health."""
    servers: list[LiveServer] = []

    def start(*args: str) -> LiveServer:
        server = LiveServer(*args)
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()
