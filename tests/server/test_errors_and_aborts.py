"""Error bodies, API keys, the waiting-queue limit and client disconnects, on a live server.

The server runs one sequence at a time (``--max-num-seqs 1``) with room for one waiting
request (``--max-waiting-requests 1``), so queueing is easy to provoke.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL

MAX_MODEL_LEN = 256
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1", "--max-waiting-requests", "1",
        "--return-tokens-as-token-ids", "--enable-request-id-headers",
    )  # fmt: skip


def test_server_wide_token_ids_and_request_id_headers(http):
    # --return-tokens-as-token-ids: logprobs name tokens by id for every request.
    body = completion(max_tokens=2, temperature=0, logprobs=1)
    answer = http.post(COMPLETIONS, json=body, headers={"X-Request-Id": "trace-7"})
    assert answer.headers["X-Request-Id"] == "trace-7"
    tokens = answer.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 2 and all(t.removeprefix("token_id:").isdigit() for t in tokens)
    # --enable-request-id-headers: a fresh id where the request sent none, errors included.
    refused = http.post(COMPLETIONS, json=completion(max_tokens=-1))
    assert refused.status_code == 400
    assert re.fullmatch("[0-9a-f]{32}", refused.headers["X-Request-Id"])


def completion(**body) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 3, **body}


def chat(**body) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        **body,
    }


def assert_still_serving(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=completion(temperature=0))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, completion(temperature=-1), "temperature"),
        (COMPLETIONS, completion(top_p=0), "top_p"),
        (COMPLETIONS, completion(n=0), "n"),
        (COMPLETIONS, completion(logprobs=21), "logprobs"),
        (COMPLETIONS, completion(presence_penalty=3), "presence_penalty"),
        (COMPLETIONS, completion(logit_bias={"banana": 1}), "logit_bias"),
        (COMPLETIONS, completion(logit_bias={"99999999": 1}), "logit_bias"),
        (COMPLETIONS, completion(stop_token_ids=[10**9]), "stop_token_ids"),
        (COMPLETIONS, completion(min_tokens=5, max_tokens=2), "min_tokens"),
        (COMPLETIONS, completion(stop=["ok", ""]), "stop"),
        (COMPLETIONS, completion(prompt=""), "prompt"),
        (COMPLETIONS, completion(prompt=[[]]), "prompt"),
        (COMPLETIONS, completion(prompt=[10**9]), "prompt"),
        (COMPLETIONS, completion(prompt="hello " * 300), "prompt"),
        (COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN + 1), "max_tokens"),
        (COMPLETIONS, completion(max_tokens=0), "max_tokens"),
        (COMPLETIONS, completion(max_tokens=0, echo=True, min_tokens=1), "min_tokens"),
        (COMPLETIONS, completion(prompt_logprobs=-1), "prompt_logprobs"),
        (COMPLETIONS, completion(prompt_logprobs=21), "prompt_logprobs"),
        (COMPLETIONS, completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
        (COMPLETIONS, completion(echo=True, logprobs=21), "logprobs"),
        (COMPLETIONS, completion(stream_options={"include_usage": True}), "stream_options"),
        (COMPLETIONS, completion(prompt=None), "prompt"),
        (COMPLETIONS, completion(prompt=["text", 1]), "prompt"),
        (COMPLETIONS, completion(seed=2**64), "seed"),
        (COMPLETIONS, completion(seed=2**63 - 1, n=2), "seed"),
        (COMPLETIONS, completion(cache_salt=""), "cache_salt"),
        (CHAT, chat(messages=[]), "messages"),
        (CHAT, chat(top_logprobs=2), "top_logprobs"),
        (CHAT, chat(prompt_logprobs=-1), "prompt_logprobs"),
        (CHAT, chat(prompt_logprobs=21), "prompt_logprobs"),
        (CHAT, chat(prompt_logprobs=1, stream=True), "prompt_logprobs"),
        (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
        # A field validator's error is its field's, whatever word the message starts with.
        (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages"),
        # vLLM's beam search: refused, not answered with samples.
        (COMPLETIONS, completion(use_beam_search=True, n=2), "use_beam_search"),
        (CHAT, chat(use_beam_search=True, length_penalty=2.0), "use_beam_search"),
        (CHAT, chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools"),
        (CHAT, chat(messages=[{"role": "user", "content": "hi " * 300}]), "messages"),
        # Far over the context by length alone: refused before it is tokenized.
        (COMPLETIONS, completion(prompt="x" * 50_000), "prompt"),
        (CHAT, chat(messages=[{"role": "user", "content": "x" * 50_000}]), "messages"),
        (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens"),
        (CHAT, chat(response_format={"type": "xml"}), "response_format"),
        (CHAT, chat(response_format={"type": "json_schema"}), "response_format"),
        (
            CHAT,
            chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 1}}}),
            "response_format",
        ),
        (COMPLETIONS, completion(structured_outputs={"regex": "(a"}), "structured_outputs"),
        (COMPLETIONS, completion(structured_outputs={"choice": []}), "structured_outputs"),
        (
            COMPLETIONS,
            completion(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
            "structured_outputs",
        ),
        # tool_choice defaults to "auto", which needs --enable-auto-tool-choice.
        (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
        # Request templates need --trust-request-chat-template.
        (CHAT, chat(chat_template="{{ messages }}"), "chat_template"),
        (CHAT, chat(chat_template_kwargs={"chat_template": "{{ messages }}"}), "chat_template"),
        (CHAT, chat(chat_template_kwargs={"chat_template": 1}), "chat_template_kwargs"),
        (CHAT, chat(function_call="auto"), "function_call"),
        (CHAT, chat(messages=[{"role": "tool", "content": "21 C"}]), "messages"),
        (COMPLETIONS, completion(guided_regex="(a"), "guided_regex"),
        (
            COMPLETIONS,
            completion(guided_json={"type": "object"}, structured_outputs={"regex": "a"}),
            "guided_json",
        ),
        (
            CHAT,
            chat(guided_choice=["a"], response_format={"type": "json_object"}),
            "guided_choice",
        ),
    ],
)
def test_invalid_parameters_get_400_with_openai_error_body(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["param"] == param
    assert error["code"] == 400
    assert error["message"]


def test_malformed_json_is_a_400(http):
    response = http.post(
        COMPLETIONS, content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    # Not FastAPI's loc ("body", <character position>) as if the position were a parameter.
    assert error["param"] is None
    assert error["message"].startswith("the request body is not valid JSON")
    unterminated = http.post(
        COMPLETIONS, content=b'{"model": "x', headers={"Content-Type": "application/json"}
    )
    assert unterminated.json()["error"]["message"] == (
        "the request body is not valid JSON: Unterminated string starting at character 10"
    )
    empty = http.post(COMPLETIONS, content=b"", headers={"Content-Type": "application/json"})
    assert empty.status_code == 400
    assert empty.json()["error"]["message"] == "the request body is missing: send a JSON object"
    assert_still_serving(http)


def test_json_under_another_content_type_is_a_400_saying_so(http):
    # FastAPI parses JSON only under a JSON content type (as vLLM's server does); the body
    # must not be taken for a parameter that is "not a valid dictionary".
    body = json.dumps(chat()).encode()
    for headers, got in (
        ({"Content-Type": "text/plain"}, "Content-Type: text/plain"),
        ({}, "no Content-Type"),
    ):
        response = http.post(CHAT, content=body, headers=headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("BadRequestError", None, 400)
        assert error["message"] == (
            f"the request body must be JSON sent with 'Content-Type: application/json' (got {got})"
        )
    assert_still_serving(http)


def test_legacy_function_calling_is_refused_toward_tools(server):
    client = server.openai_client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            functions=[{"name": "get_weather", "parameters": {"type": "object"}}],
            function_call={"name": "get_weather"},
            max_tokens=3,
        )
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == "functions"
    assert "use tools and tool_choice instead" in refused.value.body["message"]


def test_tool_message_without_tool_call_id_is_refused_by_index(http):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "21 C"},
    ]
    response = http.post(CHAT, json=chat(messages=messages))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert error["message"] == (
        "messages: messages[2].tool_call_id is required: a 'tool' message answers the tool "
        "call with that id"
    )
    messages[2]["tool_call_id"] = "call_1"
    assert http.post(CHAT, json=chat(messages=messages)).status_code == 200


def test_untrusted_request_chat_template_is_refused_with_vllms_message(http):
    response = http.post(CHAT, json=chat(chat_template="{% for %}"))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "Chat template is passed with request, but --trust-request-chat-template is not set. "
        "Refused request with untrusted chat template."
    )


def raw_chat(fields: str) -> str:
    """A chat request body as JSON text: one user message, then ``fields``."""
    return '{"messages": [{"role": "user", "content": "Hi"}], ' + fields + "}"


FINITE = "Input should be a finite number"


@pytest.mark.parametrize(
    ("path", "raw", "param", "reason"),
    [
        # Python's JSON parser accepts NaN and Infinity; no range check is meaningful for them.
        (COMPLETIONS, '{"prompt": "x", "temperature": NaN}', "temperature", FINITE),
        (COMPLETIONS, '{"prompt": "x", "top_p": Infinity}', "top_p", FINITE),
        (COMPLETIONS, '{"prompt": "x", "presence_penalty": -Infinity}', "presence_penalty", FINITE),
        (COMPLETIONS, '{"prompt": "x", "logit_bias": {"1": NaN}}', "logit_bias", FINITE),
        (CHAT, raw_chat('"min_p": NaN'), "min_p", FINITE),
        (CHAT, raw_chat('"repetition_penalty": Infinity'), "repetition_penalty", FINITE),
        # JSON allows "\ud800" but the tokenizer refuses it: this was a 500 (TypeError).
        (COMPLETIONS, '{"prompt": "\\ud800 x", "max_tokens": 3}', "prompt", "not valid Unicode"),
        (
            COMPLETIONS,
            '{"prompt": ["ok", "\\udfff"], "max_tokens": 3}',
            "prompt",
            "not valid Unicode",
        ),
        (
            CHAT,
            '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 3}',
            "messages",
            "not valid Unicode",
        ),
        # Any other field's lone surrogate too: these were 500s (the tokenizer, or the
        # response's UTF-8 encoding, refused them after the model had run).
        (
            COMPLETIONS,
            '{"prompt": "x", "bad_words": ["\\ud800"]}',
            "bad_words",
            "not valid Unicode",
        ),
        (
            COMPLETIONS,
            '{"prompt": "x", "request_id": "\\ud800"}',
            "request_id",
            "not valid Unicode",
        ),
        (COMPLETIONS, '{"prompt": "x", "model": "\\udc00"}', "model", "not valid Unicode"),
        (CHAT, raw_chat('"stop": ["ok", "\\ud800"]'), "stop", "not valid Unicode"),
    ],
)
def test_json_values_the_parser_accepts_but_the_server_cannot_use_are_400s(
    http, path, raw, param, reason
):
    response = http.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(param)
    assert reason in error["message"]
    assert_still_serving(http)


def test_unsupported_content_part_is_named(http):
    parts = [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    response = http.post(CHAT, json=chat(messages=[{"role": "user", "content": parts}]))
    assert response.status_code == 400, response.text
    assert "'image_url' is not supported" in response.json()["error"]["message"]
    response = http.post(
        CHAT, json=chat(messages=[{"role": "user", "content": [{"type": "text"}]}])
    )
    assert response.status_code == 400, response.text
    assert "content part 0 needs a string 'text'" in response.json()["error"]["message"]


def huge_text(num_words: int, seed: int = 0) -> str:
    """Text of random made-up words (about 5.5 characters each with the space): no word repeats
    often enough for the tokenizer's word cache to make tokenizing it cheap."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(50_000)]
    return " ".join(rng.choices(words, k=num_words))


def raw_post(server, api_key: str, path: str, body: dict) -> socket.socket:
    """Send a whole POST request on a socket of its own and return the socket unread: once
    ``sendall`` returns, the server has received (nearly) all of the body."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
    sock.sendall(head.encode() + data)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the response on ``sock`` (read until the server closes)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_huge_prompt_is_refused_before_it_is_tokenized(server, api_key, http):
    # ~4 MB of text would take seconds of CPU to tokenize (on the tokenizer thread, off the
    # event loop: tests/server/test_async_tokenizer.py); by its length alone it cannot fit 256
    # tokens, so it is refused without being tokenized, and /health answers as ever.
    sock = raw_post(server, api_key, COMPLETIONS, completion(prompt=huge_text(700_000)))
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    status, body = read_response(sock)
    assert status == 400
    assert body["error"]["param"] == "prompt"
    assert "refused before tokenizing" in body["error"]["message"]
    assert_still_serving(http)


def test_openai_client_sees_bad_request_and_not_found(server, api_key, http):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=-0.5)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}]
        )
    assert missing.value.status_code == 404
    assert "no-such-model" in missing.value.body["message"]
    assert missing.value.body["param"] == "model"
    assert_still_serving(http)


def test_api_key_is_required_on_v1_only(server, api_key, http):
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    wrong = httpx.post(
        f"{server.url}{COMPLETIONS}",
        json=completion(),
        headers={"Authorization": "Bearer wrong"},
    )
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "AuthenticationError"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert http.get("/v1/models").status_code == 200


def test_a_request_without_the_key_gets_401_before_its_body_is_read(server):
    # A malformed body, no key: the key is checked first, so nothing about the body is told.
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(
            f"{server.url}{COMPLETIONS}",
            content=b'{"model": ',
            headers={"Content-Type": "application/json", **headers},
        )
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(f"{server.url}/kv_events").status_code == 401


def open_stream(http: httpx.Client, stack: contextlib.ExitStack, **body) -> Iterator[dict]:
    """Start a streamed completion; yields its chunks. The connection stays open until
    ``stack`` closes (a generator of ``iter_lines`` left behind would close it early)."""
    response = stack.enter_context(
        http.stream("POST", COMPLETIONS, json=completion(stream=True, **body))
    )
    assert response.status_code == 200
    return (
        json.loads(line.removeprefix("data: "))
        for line in response.iter_lines()
        if line.startswith("data: ") and line != "data: [DONE]"
    )


def take(chunks: Iterator[dict], count: int) -> list[dict]:
    return [next(chunks) for _ in range(count)]


def idle(server) -> bool:
    metrics = server.metrics()

    def value(name: str) -> float:
        return metrics[(name, (("model_name", MODEL),))]

    return (
        value("vllm:num_requests_running") == 0
        and value("vllm:num_requests_waiting") == 0
        and value("kvpilot:kv_cache_free_blocks") == value("kvpilot:kv_cache_total_blocks")
    )


def aborted(server) -> float:
    return server.metric("vllm:request_success_total", finished_reason="abort")


def test_disconnect_mid_stream_frees_blocks_and_bad_input_does_not_disturb(server, http):
    aborts = aborted(server)
    with contextlib.ExitStack() as stack:
        chunks = open_stream(http, stack, **LONG)
        first = take(chunks, 2)
        assert server.metric("vllm:num_requests_running") == 1
        assert server.metric("vllm:kv_cache_usage_perc") > 0
        total = server.metric("kvpilot:kv_cache_total_blocks")
        assert server.metric("kvpilot:kv_cache_free_blocks") < total
        # Bad input while a request streams: a 400, and the stream goes on.
        assert http.post(COMPLETIONS, json=completion(top_p=7)).status_code == 400
        more = take(chunks, 2)
        assert {c["id"] for c in first + more} == {first[0]["id"]}
    server.wait_for(lambda: idle(server))
    assert aborted(server) == aborts + 1
    assert_still_serving(http)


def test_full_waiting_queue_gets_503_with_retry_after(server, http):
    aborts = aborted(server)
    with contextlib.ExitStack() as stack:
        running = open_stream(http, stack, **LONG)
        take(running, 1)
        open_stream(http, stack, **LONG)  # waits: one sequence runs at a time
        server.wait_for(lambda: server.metric("vllm:num_requests_waiting") == 1)
        refused = http.post(COMPLETIONS, json=completion())
        assert refused.status_code == 503
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        assert len(take(running, 3)) == 3  # the running request is not disturbed
    server.wait_for(lambda: idle(server))
    assert aborted(server) == aborts + 2
    assert_still_serving(http)


def test_non_streaming_client_that_gives_up_aborts_its_request(server, api_key, http):
    aborts = aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}{COMPLETIONS}",
            json=completion(**LONG),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(10, read=1.0),
        )
    server.wait_for(lambda: aborted(server) == aborts + 1)
    server.wait_for(lambda: idle(server))
    assert_still_serving(http)
