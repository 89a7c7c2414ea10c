"""Differential test of kvpilot's HTTP API against vLLM's, on the same model.

Sends one corpus of requests (completions, chat completions, models, tokenize, detokenize,
health, version, responses) to two running servers and prints, per case, where their answers
differ: the HTTP status, the OpenAI error body's shape (``error.message/type/param/code``), the
response's fields and their JSON types (``usage``, ``finish_reason``, ``stop_reason``,
``logprobs``, ...), the streaming chunks' shapes, ``data: [DONE]``, the usage-only final chunk
of ``stream_options.include_usage``, and for greedy (temperature 0) requests the generated text.
Every request is sent raw over ``httpx`` (the answers compared, malformed bodies, wrong
content types and methods included); a well-formed completion, chat, responses or models
request that succeeds is sent again through the official ``openai`` client, and what the client
could not parse (a stream it could not iterate, ...) is reported. Usage counts, finish and stop
reasons are compared by value everywhere; texts and token ids of greedy cases only. Both servers
should run float32 on CPU, so greedy texts should match; a mismatch can still be a legitimate
numeric tie. A last row checks, per server, that a seeded sampled request repeats its text.

Start both servers on the same model folder, with the same ``--served-model-name`` (the
``--model`` given here), and wait until each answers a completion (vLLM compiles for a few
minutes first):

    VLLM_PY=$(benchmarks/peers/install-vllm.sh | tail -1)
    MODEL=$(.venv/bin/python -c \
        "from kvpilot.engine.model_loader import resolve_model; print(resolve_model(None))")
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=2 "$VLLM_PY" -I benchmarks/peers/vllm_cli.py \
        serve "$MODEL" --served-model-name smollm2 --dtype float32 --max-model-len 2048 \
        --host 127.0.0.1 --port 8100 &
    .venv/bin/kvpilot serve --model "$MODEL" --served-model-name smollm2 \
        --max-model-len 2048 --host 127.0.0.1 --port 8101 &
    .venv/bin/python benchmarks/peers/api_diff.py \
        --kvpilot http://127.0.0.1:8101 --vllm http://127.0.0.1:8100 --model smollm2

A full run takes about 8 minutes on 2 cores.

``--only A,B`` runs the cases whose name contains A or B; ``--json FILE`` writes every case's
raw answers (both servers) for a closer look. Loopback only: nothing here reaches elsewhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

PROMPT = "The capital of France is"
COUNT_PROMPT = "1, 2, 3, 4, 5,"
CHAT = [{"role": "user", "content": "Name three colors."}]
# Fields whose values differ by nature between two servers (ids, clocks, versions).
VOLATILE = {"id", "created", "created_at", "system_fingerprint", "version", "model", "root"}
# The greedy outputs compared by value (the rest is compared by shape only).
VALUE_FIELDS = {"text", "content", "finish_reason", "stop_reason", "tokens", "token_strs"}
USAGE_FIELDS = {"prompt_tokens", "completion_tokens", "total_tokens", "count", "max_model_len"}


@dataclass
class Case:
    """One request sent to both servers.

    Attributes:
        name: unique, ``<api>_<what>``.
        method: HTTP method.
        path: the route, e.g. ``/v1/completions``.
        body: the JSON body (None: none); ignored when ``raw`` is given.
        raw: a raw body to send as is (malformed requests), with ``headers``.
        headers: extra request headers.
        stream: the body asks for a stream (read as server-sent events).
        greedy: compare generated texts by value.
        client: when it succeeds, send it again through the ``openai`` client (every case
            is sent raw over ``httpx`` first).
    """

    name: str
    method: str
    path: str
    body: dict[str, Any] | None = None
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    greedy: bool = False
    client: bool = True


@dataclass
class Answer:
    """What one server answered to one case.

    Attributes:
        status: the HTTP status (0: the request itself failed).
        body: the parsed JSON body, or the list of parsed SSE chunks of a stream.
        done: a stream ended with ``data: [DONE]``.
        client_error: what the ``openai`` client raised on a 2xx answer (it could not parse it).
        text: the body when it was not JSON.
        content_type: the response's media type (``Content-Type`` without parameters).
    """

    status: int
    body: Any = None
    done: bool | None = None
    client_error: str | None = None
    text: str | None = None
    content_type: str | None = None


def cmpl(name: str, greedy: bool = False, **body: Any) -> Case:
    """A ``/v1/completions`` case (default prompt and 8 tokens)."""
    body = {"prompt": PROMPT, "max_tokens": 8, **body}
    return Case(
        name, "POST", "/v1/completions", body, stream=bool(body.get("stream")), greedy=greedy
    )


def chat(name: str, greedy: bool = False, **body: Any) -> Case:
    """A ``/v1/chat/completions`` case (default messages and 8 tokens)."""
    body = {"messages": CHAT, "max_tokens": 8, **body}
    return Case(
        name, "POST", "/v1/chat/completions", body, stream=bool(body.get("stream")), greedy=greedy
    )


def raw(name: str, method: str, path: str, data: bytes | None = None, **headers: str) -> Case:
    """A raw ``httpx`` case (malformed bodies, wrong methods, plain routes)."""
    return Case(name, method, path, raw=data, headers=headers, client=False)


def post(name: str, path: str, body: dict[str, Any]) -> Case:
    """A well-formed JSON POST through ``httpx`` (routes the ``openai`` client does not have)."""
    return Case(name, "POST", path, body, client=False)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string"}},
    "required": ["color"],
}
G = {"temperature": 0}


def corpus(prompt_ids: list[int], eos_id: int) -> list[Case]:
    """Every case; ``prompt_ids`` are ``PROMPT``'s token ids, ``eos_id`` the model's EOS."""
    huge_prompt = "hello " * 3000
    return [
        # ---- /v1/completions
        cmpl("cmpl_basic", True, **G),
        cmpl("cmpl_n2", n=2, temperature=1, seed=1, max_tokens=4),
        cmpl("cmpl_best_of3", best_of=3, n=1, temperature=1, seed=1, max_tokens=4),
        cmpl("cmpl_best_of_lt_n", best_of=1, n=2, max_tokens=4),
        cmpl("cmpl_echo", True, echo=True, max_tokens=3, **G),
        cmpl("cmpl_echo_logprobs", True, echo=True, logprobs=2, max_tokens=3, **G),
        cmpl("cmpl_echo_max_tokens0", True, echo=True, max_tokens=0, **G),
        cmpl("cmpl_logprobs0", True, logprobs=0, max_tokens=3, **G),
        cmpl("cmpl_logprobs5", True, logprobs=5, max_tokens=3, **G),
        cmpl("cmpl_logprobs20", True, logprobs=20, max_tokens=2, **G),
        cmpl("cmpl_logprobs21", logprobs=21, max_tokens=2, **G),
        cmpl("cmpl_logprobs_negative", logprobs=-1, max_tokens=2, **G),
        cmpl("cmpl_prompt_token_ids", True, prompt=prompt_ids, **G),
        cmpl("cmpl_prompt_list_str", True, prompt=[PROMPT, "Paris is a"], max_tokens=4, **G),
        cmpl(
            "cmpl_prompt_list_lists", True, prompt=[prompt_ids, prompt_ids[:3]], max_tokens=4, **G
        ),
        cmpl("cmpl_prompt_bad_token_id", prompt=[1, 2, 10**9], **G),
        cmpl("cmpl_stop_multi", True, prompt=COUNT_PROMPT, stop=[" 8", " 9"], max_tokens=20, **G),
        cmpl(
            "cmpl_stop_unicode", True, prompt="La capitale de la France est", stop=["é", "ü"], **G
        ),
        cmpl("cmpl_stop_across_tokens", True, prompt=COUNT_PROMPT, stop="7, 8", max_tokens=20, **G),
        cmpl(
            "cmpl_include_stop_str",
            True,
            prompt=COUNT_PROMPT,
            stop=["7, 8"],
            include_stop_str_in_output=True,
            max_tokens=20,
            **G,
        ),
        cmpl(
            "cmpl_stop_token_ids",
            True,
            prompt=COUNT_PROMPT,
            stop_token_ids=[28],
            max_tokens=20,
            **G,
        ),
        cmpl(
            "cmpl_min_tokens",
            True,
            prompt=COUNT_PROMPT,
            min_tokens=6,
            stop=[","],
            max_tokens=10,
            **G,
        ),
        cmpl("cmpl_min_tokens_gt_max", min_tokens=9, max_tokens=4, **G),
        cmpl("cmpl_max_tokens0", max_tokens=0, **G),
        cmpl("cmpl_max_tokens1", True, max_tokens=1, **G),
        cmpl("cmpl_max_tokens_negative", max_tokens=-1, **G),
        cmpl("cmpl_max_tokens_huge", max_tokens=10**9, **G),
        cmpl("cmpl_max_tokens_over_context", max_tokens=2045, **G),
        cmpl("cmpl_max_tokens_none", True, max_tokens=None, prompt=COUNT_PROMPT, stop=[" 9"], **G),
        cmpl("cmpl_ignore_eos", True, ignore_eos=True, max_tokens=12, **G),
        cmpl("cmpl_seed", seed=1234, temperature=1.0, max_tokens=6),
        cmpl("cmpl_seed_negative", seed=-5, temperature=1.0, max_tokens=2),
        cmpl("cmpl_presence_penalty_3", presence_penalty=3.0, **G),
        cmpl("cmpl_frequency_penalty_-3", frequency_penalty=-3.0, **G),
        cmpl("cmpl_repetition_penalty_0", repetition_penalty=0.0, **G),
        cmpl("cmpl_repetition_penalty_1_5", True, repetition_penalty=1.5, **G),
        cmpl("cmpl_logit_bias_bad_key", logit_bias={"abc": 1}, **G),
        cmpl("cmpl_logit_bias_bad_value", logit_bias={"100": 200}, **G),
        cmpl("cmpl_logit_bias_out_of_vocab", logit_bias={"99999999": 1}, **G),
        cmpl("cmpl_logit_bias_ok", True, logit_bias={str(eos_id): -100}, **G),
        cmpl("cmpl_temperature_negative", temperature=-1.0),
        cmpl("cmpl_temperature_huge", temperature=1000.0, max_tokens=2, seed=0),
        cmpl("cmpl_top_p_0", top_p=0.0, temperature=1.0, max_tokens=2),
        cmpl("cmpl_top_p_gt1", top_p=1.5, temperature=1.0, max_tokens=2),
        cmpl("cmpl_top_k_-1", True, top_k=-1, **G),
        cmpl("cmpl_top_k_0", True, top_k=0, **G),
        cmpl("cmpl_top_k_-2", top_k=-2, temperature=1.0),
        cmpl("cmpl_min_p_gt1", min_p=1.5, temperature=1.0),
        cmpl(
            "cmpl_response_format_json_object",
            response_format={"type": "json_object"},
            max_tokens=10,
            **G,
        ),
        cmpl("cmpl_structured_choice", True, structured_outputs={"choice": ["yes", "no"]}, **G),
        cmpl("cmpl_structured_regex", True, structured_outputs={"regex": "[0-9]{3}"}, **G),
        cmpl("cmpl_guided_choice", guided_choice=["yes", "no"], **G),
        cmpl("cmpl_guided_json", guided_json=SCHEMA, **G),
        cmpl(
            "cmpl_skip_special_false",
            True,
            skip_special_tokens=False,
            ignore_eos=False,
            prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
            max_tokens=30,
            **G,
        ),
        cmpl("cmpl_spaces_between_special_false", True, spaces_between_special_tokens=False, **G),
        cmpl("cmpl_prompt_logprobs1", True, prompt_logprobs=1, max_tokens=2, **G),
        cmpl("cmpl_prompt_logprobs0", True, prompt_logprobs=0, max_tokens=2, **G),
        cmpl("cmpl_prompt_logprobs21", prompt_logprobs=21, max_tokens=2, **G),
        cmpl("cmpl_return_token_ids", True, return_token_ids=True, max_tokens=3, **G),
        cmpl("cmpl_stream", True, stream=True, **G),
        cmpl("cmpl_stream_usage", True, stream=True, stream_options={"include_usage": True}, **G),
        cmpl(
            "cmpl_stream_continuous_usage",
            True,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            max_tokens=3,
            **G,
        ),
        cmpl("cmpl_stream_options_without_stream", stream_options={"include_usage": True}, **G),
        cmpl(
            "cmpl_stream_n2",
            stream=True,
            n=2,
            temperature=1,
            seed=3,
            max_tokens=4,
            stream_options={"include_usage": True},
        ),
        cmpl("cmpl_stream_logprobs", True, stream=True, logprobs=2, max_tokens=3, **G),
        cmpl("cmpl_stream_echo", True, stream=True, echo=True, max_tokens=3, **G),
        cmpl(
            "cmpl_stream_prompt_list",
            True,
            stream=True,
            prompt=[PROMPT, "Paris is a"],
            max_tokens=3,
            **G,
        ),
        cmpl("cmpl_n2_greedy", True, n=2, max_tokens=4, **G),
        cmpl("cmpl_stop_empty_string", True, stop="", **G),
        cmpl("cmpl_stop_too_many", stop=[str(i) for i in range(10)], **G),
        cmpl("cmpl_truncate_prompt_tokens", True, truncate_prompt_tokens=3, **G),
        cmpl("cmpl_truncate_prompt_tokens_over", truncate_prompt_tokens=5000, **G),
        cmpl("cmpl_allowed_token_ids", True, allowed_token_ids=[28, 29, 30], max_tokens=3, **G),
        cmpl("cmpl_bad_words", True, bad_words=[" Paris"], **G),
        cmpl("cmpl_seed_huge", seed=2**64, temperature=1.0, max_tokens=2),
        cmpl("cmpl_logprobs_bool", logprobs=True, max_tokens=2, **G),
        cmpl("cmpl_priority", True, priority=0, **G),
        cmpl("cmpl_request_id", True, request_id="my-request-1", **G),
        cmpl("cmpl_cache_salt", True, cache_salt="salt", **G),
        cmpl("cmpl_length_penalty", True, length_penalty=1.0, **G),
        cmpl(
            "cmpl_return_tokens_as_token_ids",
            True,
            return_tokens_as_token_ids=True,
            logprobs=1,
            max_tokens=2,
            **G,
        ),
        cmpl(
            "cmpl_prompt_list_n2",
            prompt=[PROMPT, "Paris is a"],
            n=2,
            temperature=1,
            seed=5,
            max_tokens=3,
        ),
        cmpl(
            "cmpl_stream_prompt_list_n2",
            stream=True,
            prompt=[PROMPT, "Paris is a"],
            n=2,
            temperature=1,
            seed=5,
            max_tokens=3,
            stream_options={"include_usage": True},
        ),
        cmpl(
            "cmpl_stream_echo_logprobs", True, stream=True, echo=True, logprobs=1, max_tokens=2, **G
        ),
        cmpl(
            "cmpl_stream_prompt_logprobs", True, stream=True, prompt_logprobs=1, max_tokens=2, **G
        ),
        cmpl(
            "cmpl_stream_n2_logprobs",
            stream=True,
            n=2,
            logprobs=1,
            temperature=1,
            seed=6,
            max_tokens=3,
        ),
        cmpl("cmpl_truncate_prompt_tokens_-1", True, truncate_prompt_tokens=-1, **G),
        cmpl("cmpl_prompt_list_empty_string", prompt=[""], **G),
        cmpl(
            "cmpl_penalties_at_bounds",
            True,
            presence_penalty=2.0,
            frequency_penalty=-2.0,
            repetition_penalty=2.5,
            **G,
        ),
        cmpl("cmpl_top_p_tiny", True, top_p=1e-9, temperature=1.0, seed=0),
        cmpl("cmpl_min_p_1", min_p=1.0, temperature=1.0, seed=0),
        cmpl("cmpl_top_k_1", True, top_k=1, temperature=1.0, seed=0),
        cmpl("cmpl_logit_bias_float", True, logit_bias={"28": 1.5}, **G),
        cmpl("cmpl_structured_json_length", structured_outputs={"json": SCHEMA}, max_tokens=3, **G),
        cmpl(
            "cmpl_stop_logprobs",
            True,
            prompt=COUNT_PROMPT,
            stop="7, 8",
            logprobs=1,
            max_tokens=20,
            **G,
        ),
        cmpl(
            "cmpl_stream_stop_logprobs",
            True,
            stream=True,
            prompt=COUNT_PROMPT,
            stop="7, 8",
            logprobs=1,
            max_tokens=20,
            **G,
        ),
        cmpl(
            "cmpl_stream_stop_include",
            True,
            stream=True,
            prompt=COUNT_PROMPT,
            stop=["7, 8"],
            include_stop_str_in_output=True,
            max_tokens=20,
            **G,
        ),
        cmpl("cmpl_echo_token_ids", True, prompt=prompt_ids, echo=True, max_tokens=2, **G),
        cmpl(
            "cmpl_echo_prompt_list",
            True,
            prompt=[PROMPT, "Paris is a"],
            echo=True,
            max_tokens=2,
            **G,
        ),
        cmpl("cmpl_default_max_tokens", True, prompt=COUNT_PROMPT, max_tokens=None, **G),
        cmpl(
            "cmpl_stop_token_ids_logprobs",
            True,
            prompt=COUNT_PROMPT,
            stop_token_ids=[28],
            logprobs=0,
            max_tokens=20,
            **G,
        ),
        cmpl("cmpl_stream_bad_temperature", stream=True, temperature=-1.0),
        cmpl("cmpl_stream_huge_prompt", stream=True, prompt=huge_prompt, **G),
        cmpl("cmpl_unknown_model", model="no-such-model"),
        cmpl("cmpl_extra_field", True, foo_unknown=1, **G),
        cmpl("cmpl_wrong_type_max_tokens", max_tokens="ten"),
        cmpl("cmpl_wrong_type_prompt", prompt={"text": "x"}),
        cmpl("cmpl_wrong_type_n", n="two"),
        cmpl("cmpl_n0", n=0),
        cmpl("cmpl_empty_prompt", prompt="", **G),
        cmpl("cmpl_empty_prompt_list", prompt=[], **G),
        cmpl("cmpl_huge_prompt", prompt=huge_prompt, max_tokens=4, **G),
        cmpl("cmpl_user", True, user="alice", **G),
        cmpl("cmpl_suffix", suffix="xyz", **G),
        cmpl("cmpl_missing_prompt_model_only", prompt=None, **G),
        raw(
            "cmpl_invalid_json",
            "POST",
            "/v1/completions",
            b'{"prompt": "x",',
            **{"Content-Type": "application/json"},
        ),
        raw(
            "cmpl_wrong_content_type",
            "POST",
            "/v1/completions",
            json.dumps({"prompt": PROMPT}).encode(),
            **{"Content-Type": "text/plain"},
        ),
        raw("cmpl_no_body", "POST", "/v1/completions", None),
        raw(
            "cmpl_json_array_body",
            "POST",
            "/v1/completions",
            b"[1, 2]",
            **{"Content-Type": "application/json"},
        ),
        raw("cmpl_get", "GET", "/v1/completions"),
        # ---- /v1/chat/completions
        chat("chat_basic", True, **G),
        chat(
            "chat_system", True, messages=[{"role": "system", "content": "Be brief."}, *CHAT], **G
        ),
        chat(
            "chat_developer",
            True,
            messages=[{"role": "developer", "content": "Be brief."}, *CHAT],
            **G,
        ),
        chat("chat_empty_messages", messages=[], **G),
        chat(
            "chat_content_parts",
            True,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Name three"},
                        {"type": "text", "text": " colors."},
                    ],
                }
            ],
            **G,
        ),
        chat(
            "chat_content_bad_part",
            messages=[{"role": "user", "content": [{"type": "video", "video": "x"}]}],
            **G,
        ),
        chat("chat_unknown_role", messages=[{"role": "wizard", "content": "hi"}], **G),
        chat("chat_missing_content", messages=[{"role": "user"}], **G),
        chat(
            "chat_prefill_continue",
            True,
            messages=[*CHAT, {"role": "assistant", "content": "Red, blue"}],
            continue_final_message=True,
            add_generation_prompt=False,
            **G,
        ),
        chat(
            "chat_continue_and_add_generation",
            True,
            messages=[*CHAT, {"role": "assistant", "content": "Red"}],
            continue_final_message=True,
            add_generation_prompt=True,
            **G,
        ),
        chat("chat_add_generation_prompt_false", True, add_generation_prompt=False, **G),
        chat("chat_template_kwargs", True, chat_template_kwargs={"unused_var": 1}, **G),
        chat("chat_template_kwargs_wrong_type", chat_template_kwargs="x", **G),
        chat("chat_max_completion_tokens", True, max_completion_tokens=3, max_tokens=None, **G),
        chat("chat_both_max_tokens", True, max_completion_tokens=3, max_tokens=5, **G),
        chat("chat_logprobs", True, logprobs=True, max_tokens=3, **G),
        chat("chat_top_logprobs5", True, logprobs=True, top_logprobs=5, max_tokens=3, **G),
        chat("chat_top_logprobs0", True, logprobs=True, top_logprobs=0, max_tokens=3, **G),
        chat("chat_top_logprobs20", True, logprobs=True, top_logprobs=20, max_tokens=2, **G),
        chat("chat_top_logprobs21", logprobs=True, top_logprobs=21, max_tokens=2, **G),
        chat("chat_top_logprobs_without_logprobs", top_logprobs=3, max_tokens=2, **G),
        chat(
            "chat_response_format_json_object",
            response_format={"type": "json_object"},
            max_tokens=12,
            **G,
        ),
        chat(
            "chat_response_format_json_schema",
            True,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
            max_tokens=20,
            **G,
        ),
        chat("chat_response_format_text", True, response_format={"type": "text"}, **G),
        chat("chat_response_format_bad", response_format={"type": "yaml"}, **G),
        chat(
            "chat_structured_outputs_choice",
            True,
            structured_outputs={"choice": ["red", "blue"]},
            **G,
        ),
        chat("chat_tools_none", True, tools=[WEATHER_TOOL], tool_choice="none", **G),
        chat("chat_tools_auto", tools=[WEATHER_TOOL], tool_choice="auto", **G),
        chat("chat_tools_default_choice", tools=[WEATHER_TOOL], **G),
        chat(
            "chat_tools_required", tools=[WEATHER_TOOL], tool_choice="required", max_tokens=40, **G
        ),
        chat(
            "chat_tools_named",
            True,
            tools=[WEATHER_TOOL],
            max_tokens=30,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            **G,
        ),
        chat(
            "chat_tools_named_unknown",
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "nope"}},
            **G,
        ),
        chat("chat_tool_choice_without_tools", tool_choice="required", **G),
        chat("chat_n2", n=2, temperature=1, seed=2, max_tokens=4),
        chat("chat_stop", True, stop=["\n", ","], max_tokens=20, **G),
        chat("chat_seed", seed=99, temperature=1, max_tokens=5),
        chat("chat_skip_special_false", True, skip_special_tokens=False, max_tokens=60, **G),
        chat(
            "chat_echo",
            True,
            echo=True,
            messages=[*CHAT, {"role": "assistant", "content": "Red"}],
            add_generation_prompt=False,
            continue_final_message=True,
            **G,
        ),
        chat("chat_stream", True, stream=True, **G),
        chat("chat_stream_usage", True, stream=True, stream_options={"include_usage": True}, **G),
        chat(
            "chat_stream_n2",
            stream=True,
            n=2,
            temperature=1,
            seed=4,
            max_tokens=4,
            stream_options={"include_usage": True},
        ),
        chat(
            "chat_stream_logprobs",
            True,
            stream=True,
            logprobs=True,
            top_logprobs=2,
            max_tokens=3,
            **G,
        ),
        chat(
            "chat_stream_tools_named",
            True,
            stream=True,
            tools=[WEATHER_TOOL],
            max_tokens=30,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            **G,
        ),
        chat(
            "chat_name_field",
            True,
            messages=[{"role": "user", "name": "ann", "content": "Name three colors."}],
            **G,
        ),
        chat("chat_content_null", messages=[{"role": "user", "content": None}], **G),
        chat(
            "chat_tool_message",
            True,
            tools=[WEATHER_TOOL],
            messages=[
                *CHAT,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            **G,
        ),
        chat(
            "chat_parallel_tool_calls_false",
            True,
            tools=[WEATHER_TOOL],
            tool_choice="none",
            parallel_tool_calls=False,
            **G,
        ),
        chat("chat_reasoning_effort", True, reasoning_effort="low", **G),
        chat("chat_logprobs_int", logprobs=2, **G),
        chat("chat_n2_greedy", True, n=2, max_tokens=4, **G),
        chat(
            "chat_stream_include_usage_false",
            True,
            stream=True,
            stream_options={"include_usage": False},
            max_tokens=3,
            **G,
        ),
        chat("chat_metadata_store", True, metadata={"k": "v"}, store=False, **G),
        chat(
            "chat_stream_n2_logprobs",
            stream=True,
            n=2,
            logprobs=True,
            top_logprobs=1,
            temperature=1,
            seed=7,
            max_tokens=3,
            stream_options={"include_usage": True},
        ),
        chat(
            "chat_stream_prefill_continue",
            True,
            stream=True,
            messages=[*CHAT, {"role": "assistant", "content": "Red, blue"}],
            continue_final_message=True,
            add_generation_prompt=False,
            **G,
        ),
        chat("chat_prompt_logprobs", True, prompt_logprobs=1, max_tokens=2, **G),
        chat(
            "chat_json_schema_strict",
            True,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "c", "schema": SCHEMA, "strict": True},
            },
            max_tokens=20,
            **G,
        ),
        chat(
            "chat_logprobs_unicode",
            True,
            logprobs=True,
            top_logprobs=1,
            max_tokens=12,
            messages=[{"role": "user", "content": "Write 'héllo wörld 🌟' twice."}],
            **G,
        ),
        chat("chat_stream_unknown_model", stream=True, model="no-such-model"),
        chat("chat_max_completion_tokens0", max_completion_tokens=0, max_tokens=None, **G),
        chat("chat_max_tokens_over_context", True, max_tokens=2040, **G),
        chat("chat_unknown_model", model="no-such-model"),
        chat("chat_extra_field", True, foo_unknown=[1], **G),
        chat("chat_wrong_type_messages", messages="hi"),
        chat("chat_wrong_type_temperature", temperature="hot"),
        chat("chat_missing_messages", messages=None),
        chat("chat_huge_prompt", messages=[{"role": "user", "content": huge_prompt}], **G),
        chat("chat_user", True, user="bob", **G),
        chat("chat_logit_bias_bad_key", logit_bias={"x": 1}, **G),
        chat("chat_n0", n=0),
        raw(
            "chat_invalid_json",
            "POST",
            "/v1/chat/completions",
            b"{not json",
            **{"Content-Type": "application/json"},
        ),
        raw(
            "chat_wrong_content_type",
            "POST",
            "/v1/chat/completions",
            json.dumps({"messages": CHAT}).encode(),
            **{"Content-Type": "application/x-www-form-urlencoded"},
        ),
        raw("chat_get", "GET", "/v1/chat/completions"),
        # ---- models, tokenize, detokenize, health, version, responses
        Case("models_list", "GET", "/v1/models"),
        Case("models_retrieve", "GET", "/v1/models/{model}"),
        Case("models_retrieve_unknown", "GET", "/v1/models/no-such-model"),
        post("tokenize_prompt", "/tokenize", {"prompt": PROMPT}),
        post("tokenize_no_special", "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}),
        post("tokenize_token_strs", "/tokenize", {"prompt": PROMPT, "return_token_strs": True}),
        post("tokenize_messages", "/tokenize", {"messages": CHAT}),
        post(
            "tokenize_messages_no_generation_prompt",
            "/tokenize",
            {"messages": CHAT, "add_generation_prompt": False},
        ),
        post(
            "tokenize_both_prompt_and_messages", "/tokenize", {"prompt": PROMPT, "messages": CHAT}
        ),
        post("tokenize_unknown_model", "/tokenize", {"prompt": PROMPT, "model": "no-such-model"}),
        post("tokenize_missing", "/tokenize", {}),
        post("detokenize", "/detokenize", {"tokens": prompt_ids}),
        post("detokenize_out_of_vocab", "/detokenize", {"tokens": [1, 10**9]}),
        post("detokenize_negative", "/detokenize", {"tokens": [-1]}),
        post("detokenize_wrong_type", "/detokenize", {"tokens": "abc"}),
        raw("tokenize_get", "GET", "/tokenize"),
        raw("health", "GET", "/health"),
        raw("version", "GET", "/version"),
        raw("unknown_route", "GET", "/v1/no-such-route"),
        raw("post_on_models", "POST", "/v1/models", b"{}", **{"Content-Type": "application/json"}),
        Case(
            "responses_basic",
            "POST",
            "/v1/responses",
            {"input": "Name three colors.", "max_output_tokens": 8, "temperature": 0},
            greedy=True,
        ),
        Case(
            "responses_stream",
            "POST",
            "/v1/responses",
            {
                "input": "Name three colors.",
                "max_output_tokens": 8,
                "temperature": 0,
                "stream": True,
            },
            stream=True,
            greedy=True,
        ),
        Case(
            "responses_unknown_model",
            "POST",
            "/v1/responses",
            {"input": "hi", "model": "no-such-model", "max_output_tokens": 4},
        ),
    ]


# ---------------------------------------------------------------------------- sending


def _json_or_text(response: httpx.Response) -> tuple[Any, str | None]:
    try:
        return response.json(), None
    except ValueError:
        return None, response.text[:300]


def _sse(response: httpx.Response) -> tuple[list[Any], bool]:
    """The JSON chunks of a server-sent event stream, and whether it ended with [DONE]."""
    chunks: list[Any] = []
    done = False
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            chunks.append(json.loads(data))
        except ValueError:
            chunks.append({"<unparsable>": data[:100]})
    return chunks, done


def _through_client(client: openai.OpenAI, case: Case, body: dict[str, Any]) -> str | None:
    """Send ``body`` through the openai client as a user would; what it raised on a 2xx, if
    anything (None: it parsed every object)."""
    known = {
        "/v1/completions": client.completions.create,
        "/v1/chat/completions": client.chat.completions.create,
        "/v1/responses": client.responses.create,
    }
    try:
        if case.method == "GET" and case.path == "/v1/models":
            client.models.list()
            return None
        if case.method == "GET" and case.path.startswith("/v1/models/"):
            client.models.retrieve(case.path.removeprefix("/v1/models/"))
            return None
        create = known[case.path]
        # The fields the client's signature names travel as such, the rest in extra_body (as a
        # user passes vLLM's own parameters).
        extra = {k: v for k, v in body.items() if v is not None}
        main_field = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
        named = {
            k: extra.pop(k) for k in ("model", main_field.get(case.path, "input")) if k in extra
        }
        result = create(**named, stream=case.stream, extra_body=extra)
        if case.stream:
            for _ in result:
                pass
        return None
    except openai.APIStatusError:
        return None  # an error status: judged from the raw answer
    except Exception as exc:  # noqa: BLE001 - any parse failure is a finding
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def send(http: httpx.Client, client: openai.OpenAI, case: Case, model: str) -> Answer:
    """Send ``case`` to one server: raw over ``httpx`` (the answer compared) and, for a
    well-formed request, again through the ``openai`` client (whether it can parse it)."""
    path = case.path.replace("{model}", model)
    case = Case(**{**case.__dict__, "path": path})
    if case.raw is not None or (case.body is None and case.method != "GET" and not case.client):
        request = http.build_request(case.method, path, content=case.raw, headers=case.headers)
    elif case.body is None:
        request = http.build_request(case.method, path, headers=case.headers)
    else:
        body = {"model": model, **case.body}
        body = {k: v for k, v in body.items() if v is not None}
        request = http.build_request(case.method, path, json=body, headers=case.headers)
    try:
        response = http.send(request, stream=case.stream)
    except httpx.HTTPError as exc:
        return Answer(0, text=f"{type(exc).__name__}: {exc}")
    media_type = response.headers.get("content-type", "").split(";")[0].strip() or None
    try:
        if case.stream and response.status_code == 200:
            chunks, done = _sse(response)
            answer = Answer(200, chunks, done, content_type=media_type)
        else:
            response.read()
            parsed, text = _json_or_text(response)
            answer = Answer(response.status_code, parsed, text=text, content_type=media_type)
    finally:
        response.close()
    if case.client and 200 <= answer.status < 300:
        body = {"model": model, **(case.body or {})}
        answer.client_error = _through_client(client, case, body)
    return answer


# ---------------------------------------------------------------------------- comparing


def shape(
    value: Any, path: str = "", out: dict[str, set[str]] | None = None
) -> dict[str, set[str]]:
    """``{json path: {json type names}}`` of ``value``; list items merge under ``path[]``,
    and the keys of a ``top_logprobs`` dict (tokens) under ``path{}``."""
    out = {} if out is None else out
    kind = {
        dict: "object",
        list: "array",
        str: "string",
        bool: "bool",
        int: "number",
        float: "number",
        type(None): "null",
    }[type(value)]
    out.setdefault(path or "$", set()).add(kind)
    if isinstance(value, dict):
        # Dicts keyed by tokens or token ids (completions' top_logprobs, prompt_logprobs).
        token_keyed = path.endswith(("top_logprobs[]", "prompt_logprobs[]")) and not {
            "token",
            "logprob",
        } & set(value)
        for key, item in value.items():
            shape(item, f"{path}{{}}" if token_keyed else f"{path}.{key}", out)
    elif isinstance(value, list):
        for item in value:
            shape(item, f"{path}[]", out)
    return out


def _values(value: Any, path: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """The leaves worth comparing by value (``VALUE_FIELDS``, usage counts), by path."""
    out = {} if out is None else out
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}"
            if key in VALUE_FIELDS | USAGE_FIELDS and not isinstance(item, dict | list):
                out[sub] = item
            elif (
                key in VALUE_FIELDS
                and isinstance(item, list)
                and all(isinstance(x, int | str) for x in item)
            ):
                out[sub] = item
            else:
                _values(item, sub, out)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _values(item, f"{path}[{index}]", out)
    return out


def _stream_summary(chunks: list[Any]) -> dict[str, Any]:
    """A stream's texts, finish reasons and usage chunks, per choice index."""
    texts: dict[str, str] = {}
    summary: dict[str, Any] = {}
    usage_chunks = 0
    for chunk in chunks:
        if not isinstance(chunk, dict):
            continue
        if chunk.get("usage"):
            usage_chunks += 1
            summary["usage"] = {
                k: chunk["usage"].get(k) for k in sorted(USAGE_FIELDS) if k in chunk["usage"]
            }
        for choice in chunk.get("choices") or []:
            index = str(choice.get("index"))
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content") or ""
            texts[index] = texts.get(index, "") + piece
            if choice.get("finish_reason"):
                summary[f"finish_reason[{index}]"] = choice["finish_reason"]
        if chunk.get("type") == "response.completed":
            summary["response.status"] = chunk.get("response", {}).get("status")
    summary["texts"] = texts
    summary["usage_chunks"] = usage_chunks
    summary["last_chunk_choices"] = (
        len(chunks[-1].get("choices") or []) if chunks and isinstance(chunks[-1], dict) else None
    )
    return summary


def _error_shape(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return {"error_body": "not OpenAI's {error: {...}}" if body is not None else "not JSON"}
    error = body["error"]
    # Presence (not wording) of type and param: vLLM names pydantic locations ("body.n") and
    # HTTP reasons ("Bad Request") where kvpilot names the parameter and the client's class.
    return {
        "error.message": isinstance(error.get("message"), str),
        "error.type": isinstance(error.get("type"), str),
        "error.param": error.get("param") is not None,
        "error.code": error.get("code"),
    }


def compare(case: Case, ours: Answer, theirs: Answer) -> list[tuple[str, Any, Any]]:
    """The differences ``(what, kvpilot's, vLLM's)`` between two answers to ``case``."""
    diffs: list[tuple[str, Any, Any]] = []
    if ours.status != theirs.status:
        diffs.append(("status", ours.status, theirs.status))
    if ours.content_type != theirs.content_type:
        diffs.append(("content-type", ours.content_type, theirs.content_type))
    if ours.client_error != theirs.client_error:
        diffs.append(("openai client", ours.client_error, theirs.client_error))
    if ours.status >= 400 or theirs.status >= 400:
        if ours.status >= 400 and theirs.status >= 400:
            a, b = _error_shape(ours.body), _error_shape(theirs.body)
            if "error_body" in a or "error_body" in b:  # one is not OpenAI's shape at all
                ok = "OpenAI's {error: {...}}"
                a, b = (
                    {"error_body": a.get("error_body", ok)},
                    {"error_body": b.get("error_body", ok)},
                )
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    diffs.append((key, a.get(key), b.get(key)))
        return diffs
    if ours.text is not None or theirs.text is not None:
        if (ours.text is None) != (theirs.text is None):
            diffs.append(("body", ours.text or "JSON", theirs.text or "JSON"))
        return diffs
    if case.stream:
        if ours.done != theirs.done:
            diffs.append(("[DONE]", ours.done, theirs.done))
        if len(ours.body or []) != len(theirs.body or []) and case.greedy:
            diffs.append(("chunks (count)", len(ours.body or []), len(theirs.body or [])))
        a, b = _stream_summary(ours.body or []), _stream_summary(theirs.body or [])
        for key in sorted(set(a) | set(b)):
            if key == "texts" and not case.greedy:
                if sorted(a["texts"]) != sorted(b["texts"]):
                    diffs.append(("stream choice indexes", sorted(a["texts"]), sorted(b["texts"])))
                continue
            if a.get(key) != b.get(key):
                diffs.append((f"stream {key}", a.get(key), b.get(key)))
        body_a: Any = ours.body or []
        body_b: Any = theirs.body or []
    else:
        body_a, body_b = ours.body, theirs.body
    sa, sb = shape(body_a), shape(body_b)
    for path in sorted(set(sa) | set(sb)):
        leaf = path.rsplit(".", 1)[-1]
        if leaf in VOLATILE and path in sa and path in sb:
            continue
        # A field one server leaves out and the other sends as null says the same (OpenAI's
        # own streams send "usage": null in every chunk but the last; vLLM leaves it out).
        if sa.get(path, set()) - {"null"} != sb.get(path, set()) - {"null"}:
            diffs.append((f"field {path}", _types(sa.get(path)), _types(sb.get(path))))
    if not case.stream:
        va, vb = _values(body_a), _values(body_b)
        for path in sorted(set(va) | set(vb)):
            leaf = path.rsplit(".", 1)[-1].split("[")[0]
            if leaf in VALUE_FIELDS - {"finish_reason", "stop_reason"} and not case.greedy:
                continue
            if path in va and path in vb and va[path] != vb[path]:
                diffs.append((f"value {path}", va[path], vb[path]))
    return diffs


def _types(kinds: set[str] | None) -> str:
    return "|".join(sorted(kinds)) if kinds else "(absent)"


def _cell(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def reproducible(http: httpx.Client, model: str) -> bool:
    """The same seeded, sampled request twice gives the same text."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7}
    texts = [http.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in "ab"]
    return texts[0] == texts[1]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written (how to start both servers), and every option's default."""


def main(argv: list[str] | None = None) -> int:
    """Run the corpus against both servers and print the differences; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--kvpilot", default="http://127.0.0.1:8101", help="kvpilot's base URL")
    parser.add_argument("--vllm", default="http://127.0.0.1:8100", help="vLLM's base URL")
    parser.add_argument(
        "--model", default="smollm2", help="the --served-model-name both servers were given"
    )
    parser.add_argument("--api-key", default="EMPTY", help="sent as the bearer key to both")
    parser.add_argument(
        "--only",
        default="",
        help="run the cases whose name contains one of these (comma-separated)",
    )
    parser.add_argument("--json", help="write every answer to this file")
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    args = parser.parse_args(argv)

    servers = {"kvpilot": args.kvpilot, "vllm": args.vllm}
    headers = {"Authorization": f"Bearer {args.api_key}"}
    https = {
        name: httpx.Client(base_url=url, headers=headers, timeout=args.timeout)
        for name, url in servers.items()
    }
    clients = {
        name: openai.OpenAI(
            base_url=f"{url}/v1", api_key=args.api_key, max_retries=0, timeout=args.timeout
        )
        for name, url in servers.items()
    }
    for name, http in https.items():
        try:
            ready = http.post(
                "/v1/completions", json={"model": args.model, "prompt": "Hi", "max_tokens": 1}
            )
        except httpx.HTTPError as exc:
            parser.error(f"{name} at {servers[name]} does not answer ({exc}); is it started?")
        if ready.status_code != 200:
            parser.error(
                f"{name} at {servers[name]} answers a completion of model {args.model!r} with "
                f"{ready.status_code}: {ready.text[:200]}"
            )
    tokenized = https["vllm"].post("/tokenize", json={"model": args.model, "prompt": PROMPT})
    prompt_ids = tokenized.json()["tokens"]
    only = args.only.split(",")
    cases = [c for c in corpus(prompt_ids, eos_id=2) if any(o in c.name for o in only)]
    if not cases:
        parser.error(f"--only {args.only!r} matches no case")
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"

    dump: dict[str, Any] = {}
    rows: list[tuple[str, str, Any, Any]] = []
    same = 0
    categories: dict[str, int] = {}
    for case in cases:
        answers = {name: send(https[name], clients[name], case, args.model) for name in servers}
        dump[case.name] = {name: answer.__dict__ for name, answer in answers.items()}
        diffs = compare(case, answers["kvpilot"], answers["vllm"])
        print(
            f"{case.name:42} kvpilot {answers['kvpilot'].status:3} vllm "
            f"{answers['vllm'].status:3} {'same' if not diffs else f'{len(diffs)} diff(s)'}",
            file=sys.stderr,
            flush=True,
        )
        if not diffs:
            same += 1
        for what, ours, theirs in diffs:
            rows.append((case.name, what, ours, theirs))
            category = what.split(" ")[0]
            categories[category] = categories.get(category, 0) + 1
    for name, http in https.items():
        rows.append(("seed_reproducible", name, reproducible(http, args.model), True))

    print(f"\n{'case':40} {'what':44} {'kvpilot':50} vllm")
    print("-" * 200)
    for case_name, what, ours, theirs in rows:
        if case_name == "seed_reproducible" and ours == theirs:
            continue
        print(f"{case_name:40} {_cell(what, 44):44} {_cell(ours, 50):50} {_cell(theirs, 60)}")
    print(
        f"\nsummary: {len(cases)} cases, {same} identical, {len(cases) - same} differing; "
        f"differences by kind: {json.dumps(dict(sorted(categories.items())))}"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dump, handle, indent=1, default=str, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
