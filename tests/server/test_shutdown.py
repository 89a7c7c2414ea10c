"""SIGTERM to ``kvpilot serve`` (what the kubelet sends after the preStop drain): the server
stops taking connections (uvicorn's graceful shutdown) but the streams in flight run to their
end before the engine loop stops (the app's lifespan ends after the last connection)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_lets_a_stream_in_flight_finish(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("llama"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "kvpilot", "serve", model, "--port", str(port),
            "--device", "cpu", "--max-model-len", "1024", "--kv-cache-memory", "64MiB"]  # fmt: skip
    with (tmp_path / "serve.log").open("wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                break
            except (urllib.error.URLError, OSError):
                assert server.poll() is None and time.monotonic() < deadline, "no server"
                time.sleep(0.2)
        body = {"model": model, "prompt": "hi", "max_tokens": 300, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert answer.readline().startswith(b"data: ")
            server.send_signal(signal.SIGTERM)
            lines = [raw.decode().strip() for raw in answer]
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert "data: [DONE]" in lines
        assert chunks[-1]["usage"]["completion_tokens"] == 300
        server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
