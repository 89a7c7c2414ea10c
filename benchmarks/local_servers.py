"""Local ``kvpilot serve`` / ``kvpilot router`` processes on loopback for the routing benchmarks
(``routing.py``, ``router_overhead.py``) and the live-server tests (``tests/server/conftest.py``,
with this folder on ``sys.path``): start, wait for ``/health``, read ``/metrics``, stop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.ports import free_port


class LocalProcess:
    """``python -m kvpilot <args> --port P`` (or any command given in full) in the background.

    Args:
        args: the ``kvpilot`` subcommand and its flags (without ``--port``), or, with
            ``command=True``, a whole command that listens on ``{port}`` (formatted in).
        env: extra environment variables.
        command: ``args`` is a whole command line.

    Attributes:
        url: ``http://127.0.0.1:P``.
    """

    def __init__(
        self, args: Sequence[str], env: dict[str, str] | None = None, command: bool = False
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if command:
            argv = [a.format(port=self.port) for a in args]
        else:
            argv = [sys.executable, "-m", "kvpilot", *args, "--port", str(self.port)]
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            argv, env={**os.environ, **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait_healthy(self, timeout_s: float = 600.0, request_timeout_s: float = 5.0) -> None:
        """Wait until ``GET /health`` answers 200 (each try waits ``request_timeout_s``).

        Raises:
            RuntimeError: the process exited, or ``timeout_s`` passed (with its log's end).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.process.args} exited with {self.process.returncode}:\n{self.output()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=request_timeout_s).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.process.args} not healthy after {timeout_s} s:\n{self.output()}")

    def output(self, limit: int = 4000) -> str:
        """The end of its stdout and stderr."""
        self.log.seek(0)
        return self.log.read()[-limit:]

    def stop(self) -> None:
        """Terminate it (kill after 30 s) and close its log."""
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def scrape(url: str, names: Sequence[str]) -> dict[str, float]:
    """``{name: value}`` from ``url``'s ``/metrics``, each summed over its label sets (a
    counter's ``_total`` sample counts for its name)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    sums = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in sums and not sample.name.endswith("_created"):
                sums[name] += sample.value
    return sums
