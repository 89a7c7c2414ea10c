"""SIGTERM to ``kvpilot serve`` (what the kubelet sends after the preStop drain): the server
stops taking connections (uvicorn's graceful shutdown) but the streams in flight run to their
end before the engine loop stops (the app's lifespan ends after the last connection); with
``--shutdown-timeout`` (vLLM's flag) they are aborted once it has passed, each ending with an
error event, and the log holds no traceback."""

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


def stream_through_sigterm(model: str, log_path, max_tokens: int, *flags: str) -> list[str]:
    """Start ``kvpilot serve``, open a streamed completion of ``max_tokens`` tokens, send
    SIGTERM after its first event, and return the stream's lines once the server has exited."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "kvpilot", "serve", model, "--port", str(port),
            "--device", "cpu", "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
            *flags]  # fmt: skip
    with log_path.open("wb") as log:
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
        body = {"model": model, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert answer.readline().startswith(b"data: ")
            server.send_signal(signal.SIGTERM)
            lines = [raw.decode().strip() for raw in answer]
        server.wait(60)
        return lines
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_sigterm_lets_a_stream_in_flight_finish(tiny_model_dir, tmp_path):
    lines = stream_through_sigterm(str(tiny_model_dir("llama")), tmp_path / "serve.log", 300)
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "data: [DONE]" in lines
    assert chunks[-1]["usage"]["completion_tokens"] == 300


def test_shutdown_timeout_aborts_the_streams_in_flight(tiny_model_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    # 1,000 tokens take the tiny model far longer than a timeout of 0 s.
    lines = stream_through_sigterm(
        str(tiny_model_dir("llama")), log_path, 1000, "--shutdown-timeout", "0"
    )
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "data: [DONE]" in lines
    assert "--shutdown-timeout passed" in events[-1]["error"]["message"]
    assert not any("usage" in e and e["usage"] for e in events)  # it did not run to its end
    log = log_path.read_text()
    assert "aborted 1 requests in flight" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_a_negative_shutdown_timeout_is_refused(tiny_model_dir):
    answer = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpilot",
            "serve",
            str(tiny_model_dir("llama")),
            "--shutdown-timeout",
            "-1",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answer.returncode != 0
    assert "--shutdown-timeout must be 0 or more seconds" in answer.stderr
