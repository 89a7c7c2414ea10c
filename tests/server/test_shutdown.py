"""SIGTERM to ``kvpilot serve`` (what the kubelet sends after the preStop drain) or Ctrl-C: the
server stops taking connections (uvicorn's graceful shutdown) but the streams in flight run to
their end before the engine loop stops (the app's lifespan ends after the last connection); with
``--shutdown-timeout`` (vLLM's flag), or at a second Ctrl-C, they are aborted, each ending with an
error event, the engine still stops cleanly, and the log holds no traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kvpilot.ports import free_port

pytestmark = pytest.mark.slow


def stream_through_signals(
    model: str,
    log_path,
    max_tokens: int,
    signals: list[int],
    *flags: str,
    sigint_ignored_at_launch: bool = False,
) -> tuple[list[str], int]:
    """Start ``kvpilot serve``, open a streamed completion of ``max_tokens`` tokens, send
    ``signals`` after its first event (each one after the server logged its shutdown), and
    return the stream's lines and the server's exit code once it has exited.
    ``sigint_ignored_at_launch``: started as a shell starts a background job (SIGINT ignored,
    which uvicorn's own handler overrides)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A --max-model-len in flags wins over the one here.
    argv = [sys.executable, "-m", "kvpilot", "serve", model, "--port", str(port),
            "--device", "cpu", "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
            *flags]  # fmt: skip
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
            if sigint_ignored_at_launch
            else None,
        )
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
            for i, sig in enumerate(signals):
                # A signal caught before the last one was handled would count once.
                while i and "Shutting down" not in log_path.read_text():
                    assert server.poll() is None and time.monotonic() < deadline, "no shutdown"
                    time.sleep(0.05)
                server.send_signal(sig)
            lines = [raw.decode().strip() for raw in answer]
        return lines, server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.parametrize(
    ("sig", "exit_code", "ignored"),
    [
        (signal.SIGTERM, -signal.SIGTERM, False),
        (signal.SIGINT, 130, False),
        (signal.SIGINT, 130, True),
    ],
    ids=["sigterm", "ctrl-c", "ctrl-c-background-job"],
)
def test_sigterm_or_ctrl_c_lets_a_stream_in_flight_finish(
    tiny_model_dir, tmp_path, sig, exit_code, ignored
):
    log_path = tmp_path / "serve.log"
    lines, code = stream_through_signals(
        str(tiny_model_dir("llama")), log_path, 300, [sig], sigint_ignored_at_launch=ignored
    )
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "data: [DONE]" in lines
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    assert code == exit_code
    log = log_path.read_text()
    assert "Application shutdown complete" in log
    assert "Traceback" not in log and "did not stop" not in log


def test_a_second_ctrl_c_aborts_the_streams_in_flight_and_still_stops_the_engine(
    tiny_model_dir, tmp_path
):
    log_path = tmp_path / "serve.log"
    # 100,000 tokens (minutes): the stream cannot end before the second Ctrl-C.
    model = tiny_model_dir("llama", max_position_embeddings=100_008)
    lines, code = stream_through_signals(
        str(model), log_path, 100_000, [signal.SIGINT, signal.SIGINT], "--max-model-len", "100008"
    )
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "data: [DONE]" in lines
    assert "interrupted twice" in events[-1]["error"]["message"]
    # A server going away is unavailable (503), not failing (500).
    assert (events[-1]["error"]["code"], events[-1]["error"]["type"]) == (
        503,
        "ServiceUnavailableError",
    )
    assert code == 130
    log = log_path.read_text()
    assert "interrupted twice: aborted 1 requests in flight" in log
    assert "Application shutdown complete" in log  # the engine was stopped, not abandoned
    assert "Traceback" not in log and "did not stop" not in log


def test_shutdown_timeout_aborts_the_streams_in_flight(tiny_model_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    # 1,000 tokens take the tiny model far longer than a timeout of 0 s.
    lines, _ = stream_through_signals(
        str(tiny_model_dir("llama")), log_path, 1000, [signal.SIGTERM], "--shutdown-timeout", "0"
    )
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "data: [DONE]" in lines
    assert "--shutdown-timeout passed" in events[-1]["error"]["message"]
    assert events[-1]["error"]["code"] == 503
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
    assert answer.returncode == 2
    assert answer.stderr == "kvpilot serve: error: --shutdown-timeout must be 0 or more seconds\n"
