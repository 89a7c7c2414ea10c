"""Structured outputs over HTTP with the official ``openai`` client: ``response_format``
``json_object`` and ``json_schema`` (and vLLM's ``structured_outputs`` extension and its older
``guided_*`` aliases), streamed or not, on a live server with the default model; invalid
schemas and JSON Schema keywords xgrammar would not enforce are 400s naming the parameter;
unconstrained requests running beside constrained ones are unchanged."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL
from tests.engine.test_structured_output import UNSUPPORTED

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, age and color."}]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-model-len", "512", "--max-num-seqs", "4")


@pytest.fixture(scope="module")
def client(server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)


def chat(client: openai.OpenAI, messages=ASK, max_tokens: int = 80, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kwargs
    )


def test_json_schema_output_validates_streamed_or_not(client):
    [choice] = chat(client, response_format=PERSON_FORMAT).choices
    person = json.loads(choice.message.content)
    jsonschema.validate(person, PERSON)
    assert choice.finish_reason == "stop"
    chunks = list(chat(client, response_format=PERSON_FORMAT, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 1  # how many depends on the reader's lag (merged steps)
    assert streamed == choice.message.content


def test_json_object_output_is_an_object(client):
    [choice] = chat(client, response_format={"type": "json_object"}).choices
    assert isinstance(json.loads(choice.message.content), dict)
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize(
    "extra_body",
    [{"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}],
)
def test_vllm_structured_outputs_on_completions(client, extra_body):
    response = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=10,
        n=3,
        temperature=1.0,
        seed=0,
        extra_body=extra_body,
    )
    assert {c.text for c in response.choices} <= {"yes", "no"}
    assert {c.finish_reason for c in response.choices} == {"stop"}


def test_invalid_schema_is_a_400_naming_response_format(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, response_format=bad)
    assert refused.value.body["param"] == "response_format"
    assert 'Unsupported type "objekt"' in refused.value.body["message"]
    assert refused.value.body["type"] == "BadRequestError"


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(client):
    plain = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 24}
    alone = chat(client, **plain).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(chat, client, response_format=PERSON_FORMAT) for _ in range(2)]
        beside = pool.submit(chat, client, **plain)
        assert beside.result().choices[0].message.content == alone
        for future in constrained:
            jsonschema.validate(json.loads(future.result().choices[0].message.content), PERSON)


def constrain(param: str, schema: dict) -> dict:
    """Request fields that constrain a chat completion to ``schema`` through ``param``."""
    if param == "response_format":
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    if param == "tools":
        function = {"name": "f", "parameters": schema}
        return {
            "tools": [{"type": "function", "function": function}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    if param == "structured_outputs":
        return {"extra_body": {"structured_outputs": {"json": schema}}}
    return {"extra_body": {param: schema}}


@pytest.mark.parametrize("param", ["response_format", "structured_outputs", "guided_json", "tools"])
@pytest.mark.parametrize(("schema", "feature", "path"), [case[:3] for case in UNSUPPORTED])
def test_unsupported_json_schema_keywords_are_400s_naming_the_parameter(
    client, param, schema, feature, path
):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, max_tokens=5, **constrain(param, schema))
    assert refused.value.body["param"] == param
    assert refused.value.body["message"] == (
        f"{param}: the JSON schema uses {feature} at {path}, which is not supported"
    )


def test_guided_aliases_constrain_chat(client):
    [choice] = chat(client, extra_body={"guided_json": PERSON}).choices
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop"
    [regex] = chat(client, max_tokens=20, extra_body={"guided_regex": "[a-z]{3}-[0-9]{2}"}).choices
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", regex.message.content)
    [answer] = chat(client, max_tokens=10, extra_body={"guided_choice": ["yes", "no"]}).choices
    assert answer.message.content in ("yes", "no")


@pytest.mark.parametrize(
    ("extra_body", "message"),
    [
        (
            {"guided_json": PERSON, "response_format": {"type": "json_object"}},
            "guided_json: cannot be combined with response_format",
        ),
        (
            {"guided_choice": ["a"], "structured_outputs": {"regex": "a"}},
            "guided_choice: cannot be combined with structured_outputs",
        ),
        (
            {"guided_regex": "a", "guided_grammar": 'root ::= "a"'},
            "guided_regex: set only one of guided_regex, guided_grammar",
        ),
        ({"guided_choice": []}, "guided_choice: choice must be a list of non-empty strings"),
        ({"guided_regex": "(a"}, "guided_regex: invalid regex: "),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern: not supported; "),
    ],
)
def test_invalid_guided_aliases_are_400s_naming_them(client, extra_body, message):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, max_tokens=5, extra_body=extra_body)
    assert refused.value.body["message"].startswith(message)
    assert refused.value.body["param"] == message.split(":")[0]
