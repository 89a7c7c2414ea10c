"""Reasoning over HTTP with the official ``openai`` client, on a live server with the default
model started with ``--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser
pythonic``: ``message.reasoning`` and ``delta.reasoning`` (no tag reaching the client, streamed
or not), ``include_reasoning``, Qwen3's ``enable_thinking``, pythonic tool calls after the
reasoning, and the 400s. Replies with a reasoning block are forced with structured outputs'
``choice``, which the parser reads as the model's output."""

from __future__ import annotations

import json

import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL
from tests.tool_use import WEATHER

ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
THOUGHT = "\nThe user asks about the weather in Paris.\n"
ANSWER = "\n\nIt is sunny in Paris."
FORCED = f"<think>{THOUGHT}</think>{ANSWER}"
CALL = 'get_weather(city="Paris", unit="celsius")'


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        "--max-model-len", "1024", "--max-num-seqs", "4", "--reasoning-parser", "qwen3",
        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client()


def chat(client: openai.OpenAI, forced: str | None = None, messages=ASK, **kwargs):
    """A greedy chat completion; ``forced`` makes the reply exactly that text."""
    extra_body = kwargs.pop("extra_body", {})
    if forced is not None:
        extra_body["structured_outputs"] = {"choice": [forced]}
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=kwargs.pop("max_tokens", 120),
        extra_body=extra_body,
        **kwargs,
    )


def assemble(chunks) -> dict:
    """A streamed choice 0 joined as a client joins it: reasoning, content, calls
    (``[(name, arguments)]``), finish reason, and the chunks that carried reasoning."""
    reply = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None, "reasoned": 0}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reasoning = getattr(choice.delta, "reasoning", None)
        reply["reasoned"] += reasoning is not None
        reply["reasoning"] += reasoning or ""
        reply["content"] += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            call = reply["calls"].setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
        reply["finish_reason"] = choice.finish_reason or reply["finish_reason"]
    reply["calls"] = [tuple(call) for _, call in sorted(reply["calls"].items())]
    return reply


def test_reply_splits_into_reasoning_and_content_streamed_or_not(client):
    response = chat(client, FORCED)
    [choice] = response.choices
    assert choice.message.reasoning == THOUGHT
    assert choice.message.content == ANSWER
    assert choice.finish_reason == "stop"
    assert "reasoning_content" not in choice.message.model_dump()  # vLLM 0.32 sends reasoning
    streamed = assemble(chat(client, FORCED, stream=True))
    assert (streamed["reasoning"], streamed["content"]) == (THOUGHT, ANSWER)
    assert streamed["reasoned"] >= 1 and streamed["finish_reason"] == "stop"
    # The token counts are the output's, reasoning included.
    usage = chat(client, FORCED, stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in usage if chunk.usage][-1]
    assert usage.completion_tokens == response.usage.completion_tokens
    assert usage.prompt_tokens == response.usage.prompt_tokens
    assert response.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_free_reply_without_end_tag_is_all_reasoning(client, http):
    # SmolLM2 never closes a think block: as vLLM's qwen3 parser reads it, all reasoning.
    [choice] = chat(client, max_tokens=24).choices
    prompt = http.post("/tokenize", json={"model": MODEL, "messages": ASK}).json()["tokens"]
    plain = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=24,
        extra_body={"skip_special_tokens": False},  # as the qwen3 parser asks for
    )
    assert plain.choices[0].text and "</think>" not in plain.choices[0].text
    assert choice.message.reasoning == plain.choices[0].text
    assert choice.message.content is None
    streamed = assemble(chat(client, max_tokens=24, stream=True))
    assert (streamed["reasoning"], streamed["content"]) == (plain.choices[0].text, "")


def reasoning_tokens(usage) -> int:
    return usage.completion_tokens_details.reasoning_tokens


def test_usage_counts_the_reasoning_tokens(client, default_tokenizer):
    # The reasoning ends with the token that completes "</think>" (a few tokens in SmolLM2's
    # vocabulary): found here by a linear scan of the output's prefixes.
    response = chat(client, FORCED, extra_body={"return_token_ids": True})
    ids = response.choices[0].token_ids
    ended = next(
        k
        for k in range(1, len(ids) + 1)
        if "</think>" in default_tokenizer.decode(ids[:k], skip_special_tokens=False)
    )
    assert 0 < ended < len(ids) == response.usage.completion_tokens
    assert reasoning_tokens(response.usage) == ended
    options = {"include_usage": True}
    *_, last = chat(client, FORCED, stream=True, stream_options=options)
    assert reasoning_tokens(last.usage) == ended
    # A reply that never ends its block is all reasoning; with thinking off, none is.
    free = chat(client, max_tokens=12)
    assert reasoning_tokens(free.usage) == free.usage.completion_tokens == 12
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert reasoning_tokens(chat(client, FORCED, extra_body=off).usage) == 0


def test_include_reasoning_false_leaves_the_reasoning_out(client):
    body = {"include_reasoning": False, "return_token_ids": True}
    [choice] = chat(client, FORCED, logprobs=True, extra_body=dict(body)).choices
    assert (choice.message.reasoning, choice.message.content) == (None, ANSWER)
    # Logprobs and token ids would spell the reasoning out: left out too, as vLLM does.
    assert choice.logprobs is None and getattr(choice, "token_ids", None) is None
    chunks = list(chat(client, FORCED, logprobs=True, stream=True, extra_body=dict(body)))
    streamed = assemble(chunks)
    assert (streamed["reasoned"], streamed["content"]) == (0, ANSWER)
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)


def test_qwen3_enable_thinking_false_is_all_content(client):
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    [choice] = chat(client, FORCED, extra_body=dict(body)).choices
    assert (choice.message.reasoning, choice.message.content) == (None, FORCED)
    streamed = assemble(chat(client, FORCED, stream=True, extra_body=dict(body)))
    assert (streamed["reasoned"], streamed["content"]) == (0, FORCED)


@pytest.mark.parametrize("thought", ["<think>I should look it up.</think>\n", ""])
def test_pythonic_tool_calls_are_read_after_the_reasoning(client, thought):
    forced = f"{thought}[{CALL}]"
    [choice] = chat(client, forced, tools=[WEATHER]).choices
    [call] = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert choice.message.content is None
    assert choice.message.reasoning == ("I should look it up." if thought else None)
    assert choice.finish_reason == "tool_calls"
    streamed = assemble(chat(client, forced, tools=[WEATHER], stream=True))
    assert streamed["calls"] == [("get_weather", call.function.arguments)]
    assert (streamed["reasoning"] or None, streamed["content"]) == (choice.message.reasoning, "")
    assert streamed["finish_reason"] == "tool_calls"


def test_a_call_inside_the_reasoning_is_no_call(client):
    forced = f"<think>Maybe [{CALL}]?</think>No call needed."
    [choice] = chat(client, forced, tools=[WEATHER]).choices
    assert choice.message.tool_calls is None
    assert choice.message.reasoning == f"Maybe [{CALL}]?"
    assert choice.message.content == "No call needed."
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("value", ["maybe", [True], {"on": True}, 2])
def test_include_reasoning_of_the_wrong_type_is_a_400(client, value):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, max_tokens=3, extra_body={"include_reasoning": value})
    error = refused.value.body
    assert error["param"] == "include_reasoning"
    assert error["type"] == "BadRequestError"
    assert "include_reasoning" in error["message"]
    assert chat(client, max_tokens=3).choices[0].finish_reason == "length"
