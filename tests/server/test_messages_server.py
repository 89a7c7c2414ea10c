"""``/v1/messages`` (Anthropic's Messages API) over HTTP with the official ``anthropic`` client,
on a live server with the default model, ``--reasoning-parser qwen3`` and the pythonic tool
parser (thinking off by default, ``--default-chat-template-kwargs``). Each reply is held
against the chat completion of the same conversation on the same server: text, token counts,
stop reasons, streamed events, thinking and ``tool_use`` blocks, a ``tool_result`` follow-up,
``count_tokens``, the ``x-api-key`` header, and Anthropic's error bodies. Replies with thinking
or a call are forced with structured outputs' ``choice``, as in ``test_reasoning_server.py``."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL
from tests.server.conftest import API_KEY
from tests.server.test_reasoning_server import ANSWER, CALL, FORCED, THOUGHT
from tests.server.test_responses_server import PARSER_FLAGS
from tests.tool_use import WEATHER

QUESTION = "What is the capital of France?"
ASK = [{"role": "user", "content": QUESTION}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(*PARSER_FLAGS)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    # The client sends its key as x-api-key, as Anthropic's API takes it.
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def openai_client(server) -> openai.OpenAI:
    return server.openai_client()


def create(client: anthropic.Anthropic, messages=ASK, forced: str | None = None, **kwargs):
    """A greedy reply; ``forced`` makes it exactly that text."""
    # The client (2.x) has no sampling parameters: temperature travels in the body, as vLLM
    # reads it.
    extra_body = {"temperature": 0, **kwargs.pop("extra_body", {})}
    if forced is not None:
        extra_body["structured_outputs"] = {"choice": [forced]}
    return client.messages.create(
        model=MODEL,
        messages=messages,
        max_tokens=kwargs.pop("max_tokens", 24),
        extra_body=extra_body,
        **kwargs,
    )


def prompt_tokens(usage) -> int:
    """The prompt's tokens, as Anthropic's usage splits them (uncached, read, written)."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def chat(openai_client: openai.OpenAI, messages, max_tokens: int = 24, **kwargs):
    return openai_client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kwargs
    )


def test_text_reply_is_the_chat_completion_of_the_same_conversation(client, openai_client):
    message = create(client, system="Answer in one sentence.")
    expected = chat(openai_client, [{"role": "system", "content": "Answer in one sentence."}, *ASK])
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    [block] = message.content
    assert block.type == "text" and block.text == expected.choices[0].message.content
    # Anthropic's input_tokens leave out the prefix cache's reads and writes; the three sum to
    # the prompt.
    assert prompt_tokens(message.usage) == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens
    finished = expected.choices[0].finish_reason == "stop"
    assert message.stop_reason == ("end_turn" if finished else "max_tokens")
    assert (
        client.messages.count_tokens(
            model=MODEL, system="Answer in one sentence.", messages=ASK
        ).input_tokens
        == expected.usage.prompt_tokens
    )


def test_system_turns_merge_and_claude_codes_billing_header_is_left_out(client, openai_client):
    """vLLM's rules: system turns join the system prompt (first, for the template), and Claude
    Code's per-request attribution block is dropped so that prefix caching still works."""
    expected = chat(openai_client, [{"role": "system", "content": "Be brief."}, *ASK])
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=9f3a;"}
    system = [billing, {"type": "text", "text": "Be brief."}]
    for message in (
        create(client, system=system),
        create(client, [{"role": "system", "content": "Be brief."}, *ASK]),
    ):
        assert prompt_tokens(message.usage) == expected.usage.prompt_tokens
        assert message.content[0].text == expected.choices[0].message.content


def test_a_prefill_is_continued(client, openai_client):
    """Anthropic's prefill: a last assistant turn is continued, not answered."""
    prefill = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    message = create(client, prefill, max_tokens=6)
    expected = chat(
        openai_client,
        prefill,
        max_tokens=6,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert message.content[0].text == expected.choices[0].message.content
    assert prompt_tokens(message.usage) == expected.usage.prompt_tokens


def test_cut_and_stopped_replies_say_why(client):
    cut = create(client, max_tokens=3)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)
    whole = create(client).content[0].text
    stop = " is"  # in "The capital of France is Paris."
    assert stop in whole
    stopped = create(client, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == whole[: whole.index(stop)]


def test_streamed_events_build_the_same_message(client):
    whole = create(client)
    with client.messages.stream(
        model=MODEL, messages=ASK, max_tokens=24, extra_body={"temperature": 0}
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events if e.type not in ("text",)]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)


def test_thinking_comes_as_a_thinking_block_streamed_or_not(client):
    message = create(client, forced=FORCED, max_tokens=120, extra_body=dict(THINKING))
    thinking, text = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", THOUGHT)
    assert (text.type, text.text) == ("text", ANSWER)
    with client.messages.stream(
        model=MODEL,
        messages=ASK,
        max_tokens=120,
        extra_body={"structured_outputs": {"choice": [FORCED]}, **THINKING},
    ) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == [
        ("thinking", THOUGHT),
        ("text", ANSWER),
    ]
    # Anthropic's switch turns the template's thinking on: the same reply is read as thinking.
    # ("adaptive": "enabled" needs max_tokens above its budget of at least 1024, beyond this
    # server's context; test_thinking_budget_server.py has it.)
    enabled = create(client, forced=FORCED, max_tokens=120, thinking={"type": "adaptive"})
    assert [b.type for b in enabled.content] == ["thinking", "text"]


def test_tool_use_then_its_result_continues_the_conversation(client, openai_client):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    message = create(client, ask, forced=f"[{CALL}]", tools=[WEATHER_TOOL])
    [call] = message.content
    assert (call.type, call.name) == ("tool_use", "get_weather")
    assert call.input == {"city": "Paris", "unit": "celsius"}
    assert message.stop_reason == "tool_use"
    with client.messages.stream(
        model=MODEL,
        messages=ask,
        max_tokens=24,
        tools=[WEATHER_TOOL],
        extra_body={"structured_outputs": {"choice": [f"[{CALL}]"]}},
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", call.name, call.input)
    ]
    follow_up = [
        *ask,
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 24 C"}]},
    ]  # fmt: skip
    answer = create(client, follow_up, tools=[WEATHER_TOOL])
    expected = chat(
        openai_client,
        [
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {
                    "name": call.name, "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
        ],
        tools=[WEATHER],
    )  # fmt: skip
    assert prompt_tokens(answer.usage) == expected.usage.prompt_tokens
    assert answer.content[0].text == expected.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "'image'"),
        ({"messages": [{"role": "tool", "content": "Hi"}]}, "must be user, assistant or system"),
        ({"max_tokens": None}, "max_tokens"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
         "disable_parallel_tool_use"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}},
         "budget_tokens (1024) must be less than max_tokens (8)"),
        ({"messages": [{"role": "user", "content": []}]}, "no content"),
        ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "object"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"output_config": {"effort": "ultra"}}, "output_config"),
        ({"thinking": {"type": "sometimes"}}, "'enabled', 'adaptive' or 'disabled'"),
    ],
)  # fmt: skip
def test_bad_requests_are_anthropic_400s(client, body, words):
    request = {"model": MODEL, "messages": ASK, "max_tokens": 8, **body}
    if request["max_tokens"] is None:
        del request["max_tokens"]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.post("/v1/messages", body=request, cast_to=object)
    error = refused.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_unknown_model_and_wrong_key_are_anthropic_errors(server, client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", messages=ASK, max_tokens=4)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=ASK)
    stranger = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        stranger.messages.create(model=MODEL, messages=ASK, max_tokens=4)
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_vllm_extensions_and_the_request_id_header(client):
    # The deprecated guided_* fields of chat completions work here too.
    message = create(client, extra_body={"guided_regex": "abc[0-9]{3}"}, max_tokens=12)
    assert re.fullmatch("abc[0-9]{3}", message.content[0].text)
    named = client.messages.create(
        model=MODEL, messages=ASK, max_tokens=2, extra_headers={"X-Request-Id": "trace-9"}
    )
    assert named.id == "msg_trace-9"


def test_a_body_nested_too_deeply_is_a_400(server):
    nested = "[" * 100_000 + "]" * 100_000
    body = f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [], "metadata": {nested}}}'
    reply = httpx.post(
        f"{server.url}/v1/messages",
        content=body,
        headers={"x-api-key": API_KEY, "content-type": "application/json"},
        timeout=60,
    )
    assert reply.status_code == 400 and reply.json()["type"] == "error"
