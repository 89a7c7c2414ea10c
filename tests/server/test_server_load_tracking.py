"""vLLM's ``--enable-server-load-tracking`` on live servers, over real HTTP: ``GET /load`` counts
the requests in flight on the routes that run the model, read while streams are held open
(their first event read, the rest not), and back to 0 once they end, fail or are dropped;
without the flag ``/load`` answers 0 whatever is in flight, as vLLM's does.

Command-line parsing: ``test_cli_vllm_frontend_flags.py``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL

MAX_MODEL_LEN = 1024
# A stream that runs for tens of seconds on the CPU: it is still in flight when /load is read
# right after its first event, and it ends by being dropped.
HELD = {"max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True, "temperature": 0}
FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4")


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(*FLAGS, "--enable-server-load-tracking")


def server_load(server) -> int:
    """``GET /load``'s count (no API key: the route is outside ``/v1``, as in vLLM)."""
    response = httpx.get(f"{server.url}/load", timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    assert list(body) == ["server_load"]
    return body["server_load"]


def hold_stream(
    http: httpx.Client, stack: contextlib.ExitStack, path: str, body: dict
) -> Iterator[str]:
    """Start a streamed request and read its first event; the stream stays open, unread,
    until ``stack`` closes (the client then drops the connection). Returns its line iterator,
    which the caller keeps: an iterator left to the garbage collector closes the stream."""
    response = stack.enter_context(http.stream("POST", path, json={**body, "stream": True}))
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next_event(lines)["choices"]
    return lines


def next_event(lines: Iterator[str]) -> dict:
    """The next ``data:`` event of a held stream."""
    line = next(line for line in lines if line.startswith("data: "))
    return json.loads(line.removeprefix("data: "))


def completion(**body) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 3, **body}


def chat(**body) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}


def test_load_counts_the_streams_in_flight_and_drops_them_when_they_end(server, http):
    assert server_load(server) == 0
    with contextlib.ExitStack() as first:
        held = hold_stream(http, first, "/v1/completions", completion(**HELD))
        assert server_load(server) == 1
        with contextlib.ExitStack() as second:
            dropped = hold_stream(http, second, "/v1/chat/completions", chat(**HELD))
            assert server_load(server) == 2
            # Untracked routes neither count nor change the count.
            assert http.post("/tokenize", json={"model": MODEL, "prompt": "x"}).status_code == 200
            assert server_load(server) == 2
            assert next_event(dropped)["object"] == "chat.completion.chunk"
        # The chat stream was dropped by its client: released once the server saw it go.
        server.wait_for(lambda: server_load(server) == 1)
        assert next_event(held)["object"] == "text_completion"  # the other one still runs
        assert server_load(server) == 1
    server.wait_for(lambda: server_load(server) == 0)


def test_a_stream_read_to_its_end_and_a_plain_response_are_released(server, http):
    with http.stream("POST", "/v1/completions", json=completion(stream=True)) as response:
        lines = list(response.iter_lines())
    assert "data: [DONE]" in lines
    # Released right after its last byte is sent, which the client may see first.
    server.wait_for(lambda: server_load(server) == 0)
    assert http.post("/v1/completions", json=completion()).status_code == 200
    server.wait_for(lambda: server_load(server) == 0)


def test_a_failed_request_is_released_before_its_error_is_sent(server, http):
    for path, body in (
        ("/v1/completions", completion(model="no-such-model")),
        ("/v1/chat/completions", chat(model="no-such-model")),
    ):
        assert http.post(path, json=body).status_code == 404
        assert server_load(server) == 0
    with contextlib.ExitStack() as stack:
        held = hold_stream(http, stack, "/v1/completions", completion(**HELD))
        # A request refused in its handler while another runs: the count is the other one.
        assert http.post("/v1/completions", json=completion(max_tokens=-1)).status_code == 400
        assert server_load(server) == 1
        assert next_event(held)["choices"]
    server.wait_for(lambda: server_load(server) == 0)


def test_without_the_flag_load_answers_0_as_vllm_does(start_server, api_key):
    plain = start_server(*FLAGS)
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=plain.url, headers=headers, timeout=60) as http:
        with contextlib.ExitStack() as stack:
            held = hold_stream(http, stack, "/v1/completions", completion(**HELD))
            assert server_load(plain) == 0
            assert next_event(held)["choices"]
