"""vLLM's ``/tokenize`` and ``/detokenize`` and ``GET /v1/models/{id}`` on a live server, with
the real SmolLM2 tokenizer on the test's side."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL

MAX_MODEL_LEN = 512
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def test_tokenize_a_text_as_the_tokenizer_does(server, default_tokenizer):
    text = "The capital of France is Paris. 東京は日本の首都です 🚀"
    body = httpx.post(
        f"{server.url}/tokenize",
        json={"model": MODEL, "prompt": text, "return_token_strs": True},
        timeout=30,
    ).json()
    expected = default_tokenizer(text).input_ids
    assert body["tokens"] == expected
    assert body["count"] == len(expected)
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == default_tokenizer.convert_ids_to_tokens(expected)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": expected}, timeout=30).json()
    assert back["prompt"] == default_tokenizer.decode(expected)


def test_tokenize_a_conversation_counts_what_a_chat_completion_uses(server, client):
    body = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}, timeout=30).json()
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert body["count"] == reply.usage.prompt_tokens == len(body["tokens"])
    without = httpx.post(
        f"{server.url}/tokenize",
        json={"messages": CHAT, "add_generation_prompt": False},
        timeout=30,
    ).json()
    # The generation prompt ("<|im_start|>assistant\n") is what the default adds.
    assert body["tokens"][: without["count"]] == without["tokens"]
    assert body["count"] > without["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"messages": []}, 400, None),
        ("/detokenize", {"tokens": [1, -5]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, None),
    ],
)
def test_bad_tokenizer_requests_get_openai_errors(server, path, body, status, param):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param


def test_retrieve_a_model_by_id(server, client):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
