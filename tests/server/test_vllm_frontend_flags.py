"""vLLM 0.32's frontend flags at work on live servers with the default model, over real HTTP
(the official ``openai`` client for response fields, raw SSE for the exact JSON):
``--disable-fastapi-docs``, ``--enable-log-requests`` with ``--max-log-len`` and
``--enable-log-outputs`` (read back from a ``--log-config-file`` log), ``--enable-prompt-tokens-
details`` (checked against the prefix-cache hits on ``/metrics``), ``--enable-force-include-
usage``, ``--default-chat-template-kwargs`` (with the ``qwen3`` reasoning parser),
``--exclude-tools-when-tool-choice-none`` and ``--chat-template-content-format``.

Command-line parsing and refusals: ``test_cli_vllm_frontend_flags.py``.
"""

from __future__ import annotations

import ast
import json
import re

import httpx
import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL
from tests.tool_use import WEATHER

BLOCK_SIZE = 8
MAX_LOG_LEN = 12
# Renders the template variables greeting, enable_thinking and the tools' names before the
# messages, and a message's content parts one by one in brackets: a template that loops over
# the content, so "auto" resolves to vLLM's "openai" format for it.
TEMPLATE = (
    "{%- if greeting is defined %}{{ greeting }}|{% endif %}"
    "{%- if enable_thinking is defined %}think={{ enable_thinking }}|{% endif %}"
    "{%- if tools %}tools={% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for part in m.content %}[{{ part.text }}]{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that reads the content as a string ("auto" resolves to "string" for it).
STRING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PARTS = [
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
]


def sse_events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed response, ``[DONE]`` left out."""
    events = []
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def rendered(http: httpx.Client, tokenizer, **body) -> str:
    """The chat prompt a request renders to (``/tokenize``, decoded on the test side)."""
    response = http.post("/tokenize", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return tokenizer.decode(response.json()["tokens"])


# --- a server with the flags off (vLLM's defaults), and the content format forced --------------


@pytest.fixture(scope="module")
def plain(start_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "parts.jinja"
    template.write_text(TEMPLATE)
    return start_server(
        "--max-model-len", "512", "--max-num-seqs", "4", "--chat-template", str(template),
        "--chat-template-content-format", "string",
        "--override-generation-config", '{"temperature": 0, "max_new_tokens": 5}',
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain_http(plain, api_key):
    with httpx.Client(
        base_url=plain.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as client:
        yield client


def test_docs_are_served_by_default(plain):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{plain.url}{path}", timeout=10).status_code == 200, path


def test_without_the_flags_no_prompt_tokens_details_and_no_usage_unless_asked(plain, plain_http):
    client = plain.openai_client()
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert chat.usage.prompt_tokens_details is None
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert completion.usage.prompt_tokens_details is None
    raw = plain_http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert "prompt_tokens_details" not in raw.json()["usage"]
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
    ):
        events = sse_events(plain_http, path, {"model": MODEL, "max_tokens": 2, **body})
        assert all(event.get("usage") is None for event in events), path
        usage = sse_events(
            plain_http,
            path,
            {"model": MODEL, "max_tokens": 2, "stream_options": {"include_usage": True}, **body},
        )[-1]["usage"]
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}, path


def test_a_forced_string_format_joins_the_parts_for_a_template_that_loops_over_them(
    plain_http, default_tokenizer
):
    prompt = rendered(plain_http, default_tokenizer, messages=PARTS)
    assert prompt == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"


# --- logging, usage details and forced usage, no docs -----------------------------------------


@pytest.fixture(scope="module")
def log_file(tmp_path_factory):
    return tmp_path_factory.mktemp("logs") / "server.log"


@pytest.fixture(scope="module")
def logged(start_server, log_file, tmp_path_factory):
    config = tmp_path_factory.mktemp("log-config") / "logging.json"
    config.write_text(
        json.dumps(
            {
                "version": 1,
                "disable_existing_loggers": False,
                "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
                "handlers": {
                    "file": {
                        "class": "logging.FileHandler",
                        "filename": str(log_file),
                        "formatter": "plain",
                    }
                },
                "loggers": {
                    "kvpilot": {"level": "DEBUG", "handlers": ["file"]},
                    "uvicorn.access": {"level": "INFO", "handlers": ["file"], "propagate": False},
                },
            }
        )
    )
    return start_server(
        "--max-model-len", "512", "--max-num-seqs", "4", "--block-size", str(BLOCK_SIZE),
        "--disable-fastapi-docs", "--enable-log-requests", "--enable-log-outputs",
        "--max-log-len", str(MAX_LOG_LEN), "--log-config-file", str(config),
        "--enable-prompt-tokens-details", "--enable-force-include-usage",
    )  # fmt: skip


@pytest.fixture(scope="module")
def logged_http(logged, api_key):
    with httpx.Client(
        base_url=logged.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as client:
        yield client


def log_lines(log_file, request_id: str) -> list[str]:
    return [line for line in log_file.read_text().splitlines() if request_id in line]


def test_disable_fastapi_docs_removes_docs_redoc_and_the_schema(logged):
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert httpx.get(f"{logged.url}{path}", timeout=10).status_code == 404, path
    assert httpx.get(f"{logged.url}/health", timeout=10).status_code == 200


def test_the_log_config_file_configures_uvicorn_and_kvpilot(logged, log_file):
    logged.wait_for(lambda: '"GET /health HTTP/1.1" 200' in log_file.read_text())
    text = log_file.read_text()
    assert re.search(r"^INFO uvicorn\.access: .*\"GET /health HTTP/1\.1\" 200", text, re.M)
    assert f"INFO kvpilot.server: model {MODEL} ready\n" in text
    # The engine-core process logs through the same configuration.
    assert re.search(r"^INFO kvpilot\.engine: KV cache size: \d+ tokens", text, re.M)


def test_chat_requests_and_outputs_are_logged_cut_to_max_log_len(
    logged, logged_http, log_file, default_tokenizer
):
    messages = [{"role": "user", "content": "Name a colour of the sky."}]
    prompt_ids = logged_http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()[
        "tokens"
    ]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
        "return_token_ids": True,
    }
    response = logged_http.post("/v1/chat/completions", json=body).json()
    [choice] = response["choices"]
    request_id = response["id"]
    prompt = default_tokenizer.decode(prompt_ids)
    lines = log_lines(log_file, request_id)
    assert lines[0] == (
        f"DEBUG kvpilot.server: Request {request_id} details: prompt: "
        f"{prompt[:MAX_LOG_LEN]!r}, prompt_token_ids: {prompt_ids[:MAX_LOG_LEN]}, "
        "prompt_embeds shape: None."
    )
    assert lines[1].startswith(
        f"INFO kvpilot.server: request {request_id}: {len(prompt_ids)} prompt tokens, lora None, "
        "SamplingParams("
    )
    output_ids = choice["token_ids"]
    assert lines[2] == (
        f"DEBUG kvpilot.server: Generated response {request_id} details: output_token_ids: "
        f"{output_ids[:MAX_LOG_LEN]}"
    )
    assert lines[3] == (
        f"INFO kvpilot.server: Generated response {request_id}: output: "
        f"{choice['message']['content'][:MAX_LOG_LEN]!r}, finish_reason: {choice['finish_reason']}"
    )
    assert len(lines) == 4


def test_streamed_outputs_log_each_delta_then_the_whole_reply(logged_http, log_file):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    events = sse_events(logged_http, "/v1/chat/completions", body)
    request_id = events[0]["id"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    infos = [line for line in log_lines(log_file, request_id) if line.startswith("INFO")]
    deltas = [line for line in infos if "(streaming delta)" in line]
    pattern = (
        rf"INFO kvpilot\.server: Generated response {request_id} \(streaming delta\): "
        r"output: (.*), finish_reason: (None|length|stop)"
    )
    matches = [re.fullmatch(pattern, line) for line in deltas]
    assert len(deltas) >= 2 and all(matches), deltas
    # Each delta is one token here, shorter than --max-log-len: together, the reply.
    assert "".join(ast.literal_eval(match[1]) for match in matches) == text
    assert [match[2] for match in matches][-1] == "length"
    assert infos[-1] == (
        f"INFO kvpilot.server: Generated response {request_id} (streaming complete): output: "
        f"{text[:MAX_LOG_LEN]!r}, finish_reason: streaming_complete"
    )


def test_completions_log_the_cut_prompt_text_and_no_text_for_token_ids(logged_http, log_file):
    text = "Completions log their prompt as text, cut."
    response = logged_http.post(
        "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 4}
    ).json()
    request_id = f"{response['id']}-0"
    [details, _, output_ids, output] = log_lines(log_file, request_id)
    assert details.startswith(
        f"DEBUG kvpilot.server: Request {request_id} details: prompt: {text[:MAX_LOG_LEN]!r}, "
    )
    assert output == (
        f"INFO kvpilot.server: Generated response {request_id}: output: "
        f"{response['choices'][0]['text'][:MAX_LOG_LEN]!r}, "
        f"finish_reason: {response['choices'][0]['finish_reason']}"
    )
    assert "output_token_ids: [" in output_ids
    ids = list(range(100, 130))
    response = logged_http.post(
        "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2}
    ).json()
    [details, *_] = log_lines(log_file, f"{response['id']}-0")
    assert details.endswith(
        f"details: prompt: None, prompt_token_ids: {ids[:MAX_LOG_LEN]}, prompt_embeds shape: None."
    )


def test_cached_tokens_count_the_prefix_cache_hits_of_a_repeated_prompt(logged, logged_http):
    client = logged.openai_client()
    prompt = "Prefix caching test: " + " ".join(f"word{i}" for i in range(40))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    num_prompt = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hits = logged.metric("vllm:prefix_cache_hits_total")
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole blocks, the last prompt token always computed.
    assert cached == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    logged.wait_for(lambda: logged.metric("vllm:prefix_cache_hits_total") == hits + cached)
    raw = logged_http.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
    ).json()
    # vLLM's completions report no created_cache_tokens (null), multimodal_tokens null.
    assert raw["usage"]["prompt_tokens_details"] == {
        "cached_tokens": cached,
        "created_cache_tokens": None,
        "multimodal_tokens": None,
    }


def test_chat_reports_cached_and_created_cache_tokens(logged, logged_http):
    # A system prompt of its own: no block shared with the other tests' prompts.
    messages = [
        {"role": "system", "content": "Cache test."},
        {"role": "user", "content": "Cache me: " + " ".join(map(str, range(30)))},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    first = logged_http.post("/v1/chat/completions", json=body).json()["usage"]
    num_prompt = first["prompt_tokens"]
    full = num_prompt // BLOCK_SIZE * BLOCK_SIZE
    assert first["prompt_tokens_details"] == {
        "cached_tokens": 0,
        "created_cache_tokens": full,
        "multimodal_tokens": None,
    }
    hits = logged.metric("vllm:prefix_cache_hits_total")
    second = logged.openai_client().chat.completions.create(**body)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert second.usage.prompt_tokens_details.model_extra["created_cache_tokens"] == full - cached
    logged.wait_for(lambda: logged.metric("vllm:prefix_cache_hits_total") == hits + cached)
    # Streamed: on the usage chunk, null fields left out as vLLM sends it.
    events = sse_events(logged_http, "/v1/chat/completions", body)
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": cached,
        "created_cache_tokens": full - cached,
    }
    # Completions: cached_tokens alone (created_cache_tokens is null there, left out).
    body = {"model": MODEL, "prompt": "Cache me too", "max_tokens": 1}
    events = sse_events(logged_http, "/v1/completions", body)
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_force_include_usage_streams_usage_on_every_chunk_and_at_the_end(logged):
    client = logged.openai_client()
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert last.usage.total_tokens == last.usage.prompt_tokens + 4
    assert all(chunk.usage is not None for chunk in deltas)
    assert [c.usage.completion_tokens for c in deltas][-1] == 4
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(chunk.usage is not None for chunk in chunks)


# --- chat template flags -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def templated(start_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "parts.jinja"
    template.write_text(TEMPLATE)
    return start_server(
        "--max-model-len", "512", "--max-num-seqs", "4", "--chat-template", str(template),
        "--trust-request-chat-template", "--reasoning-parser", "qwen3",
        "--default-chat-template-kwargs", '{"greeting": "Ahoy", "enable_thinking": false}',
        "--exclude-tools-when-tool-choice-none", "--scheduling-policy", "priority",
    )  # fmt: skip


@pytest.fixture(scope="module")
def templated_http(templated, api_key):
    with httpx.Client(
        base_url=templated.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as client:
        yield client


HELLO = [{"role": "user", "content": "Hello"}]


def test_default_chat_template_kwargs_reach_the_template_under_the_requests_own(
    templated_http, default_tokenizer
):
    prompt = rendered(templated_http, default_tokenizer, messages=HELLO)
    assert prompt.startswith("Ahoy|think=False|<|im_start|>user\n[Hello]<|im_end|>")
    own = {"greeting": "Hi", "enable_thinking": True}
    prompt = rendered(templated_http, default_tokenizer, messages=HELLO, chat_template_kwargs=own)
    assert prompt.startswith("Hi|think=True|<|im_start|>")
    # vLLM's merge: a request's null (or "auto") leaves the default.
    unset = {"greeting": None, "enable_thinking": "auto"}
    prompt = rendered(templated_http, default_tokenizer, messages=HELLO, chat_template_kwargs=unset)
    assert prompt.startswith("Ahoy|think=False|<|im_start|>")


def test_the_reasoning_parser_reads_the_merged_kwargs(templated):
    client = templated.openai_client()
    forced = "<think>Sky.</think>Blue."

    def reply(**kwargs):
        return (
            client.chat.completions.create(
                model=MODEL,
                messages=HELLO,
                max_tokens=30,
                temperature=0,
                extra_body={"structured_outputs": {"choice": [forced]}, **kwargs},
            )
            .choices[0]
            .message
        )

    off = reply()  # enable_thinking false by the server's default: all content
    assert (off.content, off.reasoning) == (forced, None)
    on = reply(chat_template_kwargs={"enable_thinking": True})
    assert (on.reasoning, on.content) == ("Sky.", "Blue.")


def test_tools_stay_out_of_the_template_when_tool_choice_is_none(templated_http, default_tokenizer):
    tools = [WEATHER]
    none = rendered(
        templated_http, default_tokenizer, messages=HELLO, tools=tools, tool_choice="none"
    )
    assert "tools=" not in none
    required = rendered(
        templated_http, default_tokenizer, messages=HELLO, tools=tools, tool_choice="required"
    )
    assert f"tools={WEATHER['function']['name']};|" in required


def test_auto_content_format_follows_the_template_that_renders(templated_http, default_tokenizer):
    # The server's template loops over the content: OpenAI's parts, a string as one part.
    prompt = rendered(templated_http, default_tokenizer, messages=PARTS)
    assert "<|im_start|>user\n[a][b]<|im_end|>" in prompt
    # A request's own template that reads a string: the parts joined one a line.
    prompt = rendered(
        templated_http, default_tokenizer, messages=PARTS, chat_template=STRING_TEMPLATE
    )
    assert prompt == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"


def test_the_default_models_template_gets_strings_as_before(logged_http, default_tokenizer):
    expected = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "a\nb"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered(logged_http, default_tokenizer, messages=PARTS) == expected


def test_request_priority_needs_the_priority_policy(plain, templated):
    """vLLM's ``priority`` request field: taken by a server with ``--scheduling-policy
    priority`` (any integer), a 400 naming it on an fcfs server unless 0."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    for priority in (-5, 0, 7):
        done = templated.openai_client().completions.create(
            **body, extra_body={"priority": priority}
        )
        assert done.usage.completion_tokens == 2
    client = plain.openai_client()
    assert client.completions.create(**body, extra_body={"priority": 0}).usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_body={"priority": 3},
        )
    assert refused.value.body["param"] == "priority"
    assert "--scheduling-policy priority" in refused.value.body["message"]
    for bad in ("high", 2**63, -(2**63) - 1):  # vLLM's field is an int64
        with pytest.raises(openai.BadRequestError) as refused:
            templated.openai_client().completions.create(**body, extra_body={"priority": bad})
        assert refused.value.body["param"] == "priority"


def test_the_priority_header_wins_over_the_body(plain, templated):
    """vLLM's ``X-Vllm-Priority`` header sets ``priority`` over the body's field: on an fcfs
    server a non-zero header is the same 400 as a non-zero field, a zero header lets a non-zero
    field through; a header that is not an int64 is a 400 naming it (vLLM ignores it)."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    client = plain.openai_client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**body, extra_headers={"X-Vllm-Priority": "3"})
    assert refused.value.body["param"] == "priority"
    done = client.completions.create(
        **body, extra_body={"priority": 3}, extra_headers={"X-Vllm-Priority": "0"}
    )
    assert done.usage.completion_tokens == 2
    for bad in ("high", str(2**63), "1.5"):
        with pytest.raises(openai.BadRequestError) as refused:
            templated.openai_client().chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=2, extra_headers={"X-Vllm-Priority": bad}
            )
        assert refused.value.body["param"] == "X-Vllm-Priority"


def test_the_overrides_max_new_tokens_caps_every_request(plain):
    """vLLM's ``override_max_tokens``: ``max_new_tokens`` of ``--override-generation-config``
    caps every request (completions' default of 16, and a larger ``max_tokens``); a smaller
    ``max_tokens`` stays; its temperature 0 is the default sampling (greedy, repeatable)."""
    client = plain.openai_client()
    unset = client.completions.create(model=MODEL, prompt="The capital of France is")
    assert unset.usage.completion_tokens == 5 and unset.choices[0].finish_reason == "length"
    again = client.completions.create(model=MODEL, prompt="The capital of France is")
    assert again.choices[0].text == unset.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to 20."}], max_tokens=40
    )
    assert chat.usage.completion_tokens == 5
    short = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert short.usage.completion_tokens == 2
