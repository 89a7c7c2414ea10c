"""A live ``kvpilot serve`` process on 127.0.0.1 and helpers to read its ``/metrics``."""

from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL
from kvpilot.engine.model_loader import load_tokenizer

# The process runner the routing benchmarks use (benchmarks/local_servers.py). The folder is
# appended, not prepended, so its scripts' names shadow no installed module.
sys.path.append(str(pathlib.Path(__file__).parents[2] / "benchmarks"))
from local_servers import LocalProcess  # noqa: E402

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 120


class LiveServer(LocalProcess):
    """A ``kvpilot serve <args>`` subprocess with the test key and one OpenMP thread; ``url`` is
    its base address (see ``benchmarks/local_servers.py``)."""

    def __init__(self, *args: str) -> None:
        super().__init__(["serve", *args], env={"OMP_NUM_THREADS": "1", "KVPILOT_API_KEY": API_KEY})

    def wait_ready(self) -> None:
        """Wait for ``/health`` (see ``LocalProcess.wait_healthy``).

        Raises:
            RuntimeError: the server exited, or was not ready after ``STARTUP_TIMEOUT_S``.
        """
        self.wait_healthy(STARTUP_TIMEOUT_S, request_timeout_s=2)

    def openai_client(self) -> openai.OpenAI:
        """The official client on this server's ``/v1``, with the test key and no retries."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)

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


@pytest.fixture(scope="module")
def http(server, api_key) -> Iterator[httpx.Client]:
    """Raw HTTP to the module's ``server`` fixture, authorized."""
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as client:
        yield client


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
