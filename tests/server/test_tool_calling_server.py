"""Tool calling over HTTP with the official ``openai`` client, on a live server with the default
model started with ``--enable-auto-tool-choice --tool-call-parser hermes``: named and
``required`` tool_choice (constrained, streamed or not), ``auto`` with the hermes parser,
``none``, conversations that carry tool calls and their results, and the 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL
from kvpilot.engine.model_loader import load_tokenizer
from kvpilot.engine.tokenization import apply_chat_template, parse_chat_messages
from tests.tool_use import HERMES_TEMPLATE, TIME, WEATHER

SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# A conversation after the tool ran: the assistant's call, then its result.
TOOL_RESULT = "22 degrees celsius and sunny"
FOLLOW_UP = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT},
]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        "--max-model-len", "1024", "--max-num-seqs", "4",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def chat(client: openai.OpenAI, messages=ASK, max_tokens: int = 80, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kwargs
    )


def assemble(chunks) -> tuple[str, list[dict], str | None]:
    """A streamed choice 0 as (content, calls, finish_reason); each call is
    ``{"id", "name", "arguments"}`` joined from its pieces (by ``index``)."""
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id is not None:
                assert call["id"] is None  # the id and name come once, in the first piece
                call.update(id=piece.id, name=piece.function.name)
                assert piece.type == "function"
            call["arguments"] += piece.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return content, [calls[i] for i in sorted(calls)], finish_reason


def assert_valid_call(call, allowed: set[str]) -> None:
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_returns_a_valid_call_streamed_or_not(client):
    [choice] = chat(client, tools=[WEATHER, TIME], tool_choice=NAMED).choices
    [call] = choice.message.tool_calls
    assert_valid_call(call, {"get_weather"})
    assert choice.message.content is None
    assert choice.finish_reason == "stop"  # OpenAI's and vLLM's answer to a named tool_choice
    chunks = list(chat(client, tools=[WEATHER, TIME], tool_choice=NAMED, stream=True))
    content, calls, finish_reason = assemble(chunks)
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) >= 1  # how many depends on the reader's lag (merged steps)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    assert finish_reason == "stop"


def test_required_calls_one_of_the_tools_with_valid_arguments(client):
    [choice] = chat(client, tools=[WEATHER, TIME], tool_choice="required").choices
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_valid_call(call, {"get_weather", "get_time"})
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)
    assert not choice.message.content
    assert choice.finish_reason == "tool_calls"
    chunks = chat(client, tools=[WEATHER, TIME], tool_choice="required", stream=True)
    _, calls, finish_reason = assemble(chunks)
    expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls] == expected
    assert finish_reason == "tool_calls"


def test_required_without_parallel_tool_calls_makes_one_call(client):
    ask = [{"role": "user", "content": "What time is it in Paris and in Tokyo?"}]
    response = chat(client, ask, tools=[TIME], tool_choice="required", parallel_tool_calls=False)
    [call] = response.choices[0].message.tool_calls
    assert_valid_call(call, {"get_time"})


def test_auto_with_the_hermes_parser_is_well_formed_streamed_or_not(client):
    # One earlier turn shows the hermes format (SmolLM2's template does not describe tools).
    example = '{"name": "get_weather", "arguments": {"city": "London", "unit": "celsius"}}'
    messages = [
        {"role": "user", "content": "What is the weather like in London?"},
        {"role": "assistant", "content": f"<tool_call>\n{example}\n</tool_call>"},
        *ASK,
    ]
    [choice] = chat(client, messages, max_tokens=60, tools=[WEATHER]).choices
    message = choice.message
    if message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        for call in message.tool_calls:
            assert call.id.startswith("chatcmpl-tool-")
            assert isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(message.content, str)
    content, calls, finish_reason = assemble(
        chat(client, messages, max_tokens=60, tools=[WEATHER], stream=True)
    )
    assert finish_reason == choice.finish_reason
    assert content == (message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []
    ]


PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
LYON = '{"name": "get_weather", "arguments": {"city": "Lyon"}}'


@pytest.mark.parametrize(
    ("output", "content"),
    [
        # The tester's output: whitespace between the calls and no content.
        (f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{LYON}\n</tool_call>", None),
        (
            f"Both cities.\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{LYON}\n</tool_call>",
            "Both cities.\n\n",
        ),
    ],
)
def test_hermes_streamed_and_whole_replies_agree_on_two_calls(client, output, content):
    # The output is forced (structured outputs' choice), so both replies parse the same text.
    forced = {
        "extra_body": {"structured_outputs": {"choice": [output]}},
        "tools": [WEATHER],
        "max_tokens": 200,
    }
    [choice] = chat(client, **forced).choices
    assert choice.message.content == content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    assert choice.finish_reason == "tool_calls"
    chunks = list(chat(client, stream=True, **forced))
    if content is None:
        # No chunk after the role's first one carries content, not even the "\n" between calls.
        assert all(c.choices[0].delta.content is None for c in chunks[1:] if c.choices)
    streamed_content, streamed_calls, finish_reason = assemble(chunks)
    assert streamed_content == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls
    assert finish_reason == "tool_calls"


def test_tool_choice_none_gives_plain_text(client):
    [plain] = chat(client, max_tokens=20).choices
    [choice] = chat(client, max_tokens=20, tools=[WEATHER], tool_choice="none").choices
    assert choice.message.tool_calls is None
    # SmolLM2's template renders no tools, so the prompt and the greedy reply are unchanged.
    assert choice.message.content == plain.message.content
    assert choice.finish_reason == plain.finish_reason


def test_conversation_with_a_tool_call_and_its_result_is_rendered(client, tokenizer):
    response = chat(client, FOLLOW_UP, max_tokens=20, tools=[WEATHER], tool_choice="none")
    assert response.choices[0].message.content
    expected = apply_chat_template(tokenizer, parse_chat_messages(FOLLOW_UP), tools=[WEATHER])
    assert TOOL_RESULT in tokenizer.decode(expected)
    assert response.usage.prompt_tokens == len(expected)


def test_tools_and_tool_calls_reach_a_tool_use_template(tokenizer):
    token_ids = apply_chat_template(
        tokenizer,
        parse_chat_messages(FOLLOW_UP),
        tools=[WEATHER],
        chat_template=HERMES_TEMPLATE,
    )
    prompt = tokenizer.decode(token_ids)
    assert json.dumps(WEATHER) in prompt
    # Arguments reach the template as a dict, as transformers' tool-use templates expect.
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert f"<tool_response>\n{TOOL_RESULT}\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "tool_choice: function 'x' is not among tools (get_weather)",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice: 'required' needs tools"),
        ({"tool_choice": NAMED}, "tool_choice", "tool_choice: function 'get_weather' needs tools"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "tool_choice: must be"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}
                ]
            },
            "tools",
            "tools: the parameters of function 'f' are not a valid JSON Schema",
        ),
        (
            {"tools": [{"type": "code_interpreter"}]},
            "tools",
            "tools: tool 0 has type 'code_interpreter'; only 'function' tools are supported",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools", "tools: function names must be unique"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
            "cannot be combined with response_format",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        **FOLLOW_UP[1],
                        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{x"}}],
                    },
                ]
            },
            "messages",
            "messages: message 1 tool_calls[0] arguments must be a JSON object",
        ),
    ],
)
def test_invalid_tool_requests_are_400s(client, body, param, message):
    body = {"messages": ASK, **body}
    messages = body.pop("messages")
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, messages, max_tokens=5, extra_body=body)
    error = refused.value.body
    assert error["param"] == param
    assert message in error["message"]
    # The server keeps serving.
    assert chat(client, max_tokens=3).choices[0].finish_reason == "length"
