"""``/v1/responses`` (OpenAI's Responses API) over HTTP with the official ``openai`` client, on a
live server with the default model, ``--reasoning-parser qwen3``, the pythonic tool parser and
``--enable-responses-store``. Each output is held against the chat completion of the same
conversation on the same server (whose tokens the engine tests hold against transformers):
text, prompt and output token counts, streamed events, reasoning and function-call items,
``previous_response_id``, logprobs, structured output, and the 4xx bodies. Replies with a
reasoning block or a call are forced with structured outputs' ``choice``, as in
``test_reasoning_server.py``; Qwen3's ``enable_thinking`` is off by default (the server's
``--default-chat-template-kwargs``), so that free replies are content, and on where a test
reads reasoning."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL
from tests.server.test_reasoning_server import ANSWER, CALL, FORCED, THOUGHT
from tests.tool_use import WEATHER

QUESTION = "What is the capital of France?"
# The Responses API's flat function tool (chat nests the same fields under "function").
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}


# Reasoning and pythonic tool calls as in test_reasoning_server.py, thinking off unless a
# request turns it on (shared by test_messages_server.py).
PARSER_FLAGS = (
    "--max-model-len", "1024", "--max-num-seqs", "4", "--reasoning-parser", "qwen3",
    "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
    "--default-chat-template-kwargs", '{"enable_thinking": false}',
)  # fmt: skip


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(*PARSER_FLAGS, "--enable-responses-store")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client()


def respond(client: openai.OpenAI, input=QUESTION, forced: str | None = None, **kwargs):
    """A greedy response; ``forced`` makes the reply exactly that text."""
    extra_body = kwargs.pop("extra_body", {})
    if forced is not None:
        extra_body["structured_outputs"] = {"choice": [forced]}
    return client.responses.create(
        model=MODEL,
        input=input,
        temperature=0,
        max_output_tokens=kwargs.pop("max_output_tokens", 24),
        extra_body=extra_body,
        **kwargs,
    )


def chat(client: openai.OpenAI, messages, max_tokens: int = 24):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens
    )


def test_text_reply_is_the_chat_completion_of_the_same_conversation(client):
    response = respond(client, instructions="Answer in one sentence.")
    expected = chat(
        client,
        [
            {"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": QUESTION},
        ],
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL and response.instructions == "Answer in one sentence."
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == expected.usage.completion_tokens
    assert response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens
    )
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    finished = expected.choices[0].finish_reason == "stop"
    assert response.status == ("completed" if finished else "incomplete")


def test_input_items_are_the_chat_messages(client):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": QUESTION},
    ]
    response = respond(client, items)
    expected = chat(
        client,
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": QUESTION},
        ],
    )
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens


def test_a_partial_assistant_message_is_continued(client):
    """vLLM's rule: a last assistant message that is in progress or incomplete is continued."""
    start = "The capital of France is"
    partial = {"role": "assistant", "content": [{"type": "output_text", "text": start}]}
    response = respond(client, [{"role": "user", "content": QUESTION}, {**partial,
        "status": "incomplete"}], max_output_tokens=6)  # fmt: skip
    expected = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": start}],
        temperature=0,
        max_tokens=6,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens


def test_max_output_tokens_cut_is_incomplete(client):
    response = respond(client, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert response.output[-1].status == "incomplete"
    # The client's stream helper finishes on the cut response too.
    with client.responses.stream(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=3
    ) as stream:
        final = stream.get_final_response()
    assert (final.status, final.output_text) == ("incomplete", response.output_text)
    assert final.output[-1].status == "incomplete"


def test_text_parts_are_joined_as_chat_joins_them(client):
    parts = [{"type": "input_text", "text": "The quick"}, {"type": "input_text", "text": "fox"}]
    response = respond(client, [{"role": "user", "content": parts}], max_output_tokens=2)
    chat_parts = [{"type": "text", "text": "The quick"}, {"type": "text", "text": "fox"}]
    expected = chat(client, [{"role": "user", "content": chat_parts}], max_tokens=2)
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.output_text == expected.choices[0].message.content


def test_request_id_is_the_response_id_and_settings_are_echoed(client):
    response = respond(
        client,
        max_output_tokens=2,
        prompt_cache_key="users-42",
        top_p=0.5,
        extra_body={"request_id": "resp_mine", "top_k": 1},
    )
    assert response.id == "resp_mine"
    assert (response.prompt_cache_key, response.service_tier) == ("users-42", "auto")
    assert (response.temperature, response.top_p) == (0.0, 0.5)  # as sampled
    assert response.usage.input_tokens_details.cache_write_tokens >= 0


def test_the_deprecated_guided_fields_work_as_on_chat(client):
    response = respond(client, max_output_tokens=12, extra_body={"guided_regex": "abc[0-9]{3}"})
    assert re.fullmatch("abc[0-9]{3}", response.output_text)


def test_reasoning_effort_none_turns_thinking_off(client):
    # Qwen3's parser reads enable_thinking, which reasoning.effort sets (as vLLM passes it).
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    on = respond(client, forced=FORCED, max_output_tokens=120, extra_body=dict(thinking))
    assert [item.type for item in on.output] == ["reasoning", "message"]
    effort = {"effort": "none"}
    off = respond(client, forced=FORCED, max_output_tokens=120, reasoning=effort)
    assert [item.type for item in off.output] == ["message"]
    assert off.output_text == FORCED and off.reasoning.effort == "none"
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=120,
        reasoning_effort="high",
        extra_body={"structured_outputs": {"choice": [FORCED]}},
    )
    assert reply.choices[0].message.reasoning == THOUGHT


def test_streamed_events_build_the_same_response(client):
    whole = respond(client)
    events = list(respond(client, stream=True))
    types = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",  # whatever the status, as vLLM sends it
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    added = next(e for e in events if e.type == "response.output_item.added")
    assert final.output[0].id == added.item.id
    assert {e.item_id for e in events if e.type == "response.output_text.delta"} == {added.item.id}


def test_reasoning_comes_as_a_reasoning_item_streamed_or_not(client):
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    response = respond(client, forced=FORCED, max_output_tokens=120, extra_body=dict(thinking))
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert message.type == "message" and response.output_text == ANSWER
    same = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=120,
        extra_body={"structured_outputs": {"choice": [FORCED]}, **thinking},
    )
    assert response.usage.output_tokens_details.reasoning_tokens == (
        same.usage.completion_tokens_details.reasoning_tokens
    )
    assert (
        0 < response.usage.output_tokens_details.reasoning_tokens < (response.usage.output_tokens)
    )
    events = list(
        respond(
            client, forced=FORCED, max_output_tokens=120, stream=True, extra_body=dict(thinking)
        )
    )
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == (THOUGHT, ANSWER)
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    hidden = respond(client, forced=FORCED, max_output_tokens=120, extra_body={
        **thinking, "include_reasoning": False})  # fmt: skip
    assert [item.type for item in hidden.output] == ["message"]


def test_function_call_then_its_output_continues_the_conversation(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    response = respond(client, ask, forced=f"[{CALL}]", tools=[WEATHER_TOOL])
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    events = list(respond(client, ask, forced=f"[{CALL}]", tools=[WEATHER_TOOL], stream=True))
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(arguments) == json.loads(done.arguments) == json.loads(call.arguments)
    follow_up = [
        *ask,
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"},
    ]  # fmt: skip
    answer = respond(client, follow_up, tools=[WEATHER_TOOL])
    assert answer.output[0].type == "message" and answer.usage.input_tokens > (
        response.usage.input_tokens
    )


def test_previous_response_id_continues_a_stored_response(client):
    first = respond(client, instructions="Answer in one sentence.")
    assert first.store is True
    second = respond(client, "And of Italy?", previous_response_id=first.id)
    expected = chat(
        client,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Italy?"},
        ],
    )
    # The instructions do not carry over (OpenAI's rule).
    assert second.output_text == expected.choices[0].message.content
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(first.id)
    assert missing.value.body["message"] == f"Response with id '{first.id}' not found."
    with pytest.raises(openai.NotFoundError):
        respond(client, "And of Spain?", previous_response_id=first.id)


def test_store_false_is_not_kept(client):
    response = respond(client, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_output_logprobs_are_the_tokens_of_the_text(client):
    response = respond(client, include=["message.output_text.logprobs"], top_logprobs=2)
    [part] = response.output[0].content
    assert len(part.logprobs) == response.usage.output_tokens
    # The last token is the end of the turn (SmolLM2's <|im_end|>) when the reply stopped.
    ended = "<|im_end|>" if response.status == "completed" else ""
    assert "".join(lp.token for lp in part.logprobs) == part.text + ended
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    # Greedy: each token is its position's most likely one.
    assert all(lp.top_logprobs[0].logprob == lp.logprob for lp in part.logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_output_logprobs_leave_the_reasoning_tokens_out(client, stream):
    body = {"chat_template_kwargs": {"enable_thinking": True}}
    asked = {"include": ["message.output_text.logprobs"], "max_output_tokens": 120}
    response = respond(client, forced=FORCED, extra_body=body, stream=stream, **asked)
    if stream:
        response = list(response)[-1].response
    [part] = response.output[1].content
    tokens = "".join(lp.token for lp in part.logprobs)
    assert tokens.removesuffix("<|im_end|>") == ANSWER == part.text
    reasoning = response.usage.output_tokens_details.reasoning_tokens
    assert len(part.logprobs) == response.usage.output_tokens - reasoning


def test_json_schema_text_format_constrains_the_output(client):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 12}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    response = respond(
        client,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )
    assert set(json.loads(response.output_text)) == {"capital"}
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "only 'function' tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input",
         "'input_image'"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "'call_id'"),
        ({"background": True}, "background", "not supported"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER_TOOL]},
         "tool_choice", "not among tools"),
        ({"text": {"format": {"type": "json_schema"}}}, "text", "schema"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"max_output_tokens": 10**9}, "max_output_tokens", "max_output_tokens"),
        ({"input": "word " * 5000}, "input", "input"),
        ({"input": []}, "input", "at least 1 item"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "no message"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input",
         "encrypted"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input", "'output'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"include": ["everything"]}, "include", ""),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning", ""),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": 5}}}}, "text", ""),
        # The request's own names are quoted as they are.
        ({"tools": [{**WEATHER_TOOL, "name": "send_messages"}],
          "tool_choice": {"type": "function", "name": "get_response_format"}}, "tool_choice",
         "'get_response_format' is not among tools (send_messages)"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(server, api_key, body, param, words):
    payload = {"model": MODEL, "input": QUESTION, **body}
    reply = httpx.post(
        f"{server.url}/v1/responses",
        json=payload,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_unknown_previous_response_and_model_are_404s(client):
    with pytest.raises(openai.NotFoundError) as missing:
        respond(client, previous_response_id="resp_nope")
    assert missing.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=QUESTION)
