"""vLLM's ``thinking_token_budget`` over HTTP, on live servers with the default model: one with
``--reasoning-parser deepseek_r1`` (whose ``<think>`` tags give the budget its markers), one
with a ``--reasoning-config`` that names no end. Chat completions and completions forced after
exactly N thinking tokens (token ids), Anthropic's ``thinking.budget_tokens`` enforced the same
way, and the 400 bodies: bad values, and a budget the server cannot enforce."""

from __future__ import annotations

import anthropic
import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL
from tests.server.conftest import API_KEY

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
# Every output is cut at 12 tokens, so that Anthropic's max_tokens (above its budget, at least
# 1024) costs no time.
MAX_OUTPUT = 12


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        "--max-model-len", "2048", "--max-num-seqs", "2", "--reasoning-parser", "deepseek_r1",
        "--override-generation-config", f'{{"max_new_tokens": {MAX_OUTPUT}}}',
    )  # fmt: skip


@pytest.fixture(scope="module")
def unconfigured(start_server):
    """A server whose reasoning config has no end string: it cannot enforce a budget."""
    return start_server(
        "--max-model-len", "2048", "--max-num-seqs", "1",
        "--reasoning-config", '{"reasoning_start_str": "<think>"}',
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client()


@pytest.fixture(scope="module")
def end(default_tokenizer) -> list[int]:
    return default_tokenizer.encode("</think>", add_special_tokens=False)


def thinking_chat(client: openai.OpenAI, thought: str = "", **extra):
    """A greedy reply that continues an assistant turn opened with ``<think>`` + ``thought``,
    with its token ids."""
    return client.chat.completions.create(
        model=MODEL,
        messages=[*QUESTION, {"role": "assistant", "content": "<think>" + thought}],
        temperature=0,
        max_tokens=MAX_OUTPUT,
        extra_body={
            "add_generation_prompt": False,
            "continue_final_message": True,
            "return_token_ids": True,
            **extra,
        },
    ).choices[0]


def test_chat_is_forced_to_end_its_thinking_after_the_budget(client, end):
    free = thinking_chat(client)
    assert free.message.content is None  # SmolLM2 never closes the block itself
    budgeted = thinking_chat(client, thinking_token_budget=3)
    assert budgeted.token_ids[:6] == free.token_ids[:3] + end
    # The parser reads the forced end: three tokens of reasoning, then the answer.
    assert free.message.reasoning.startswith(budgeted.message.reasoning)
    assert budgeted.message.content
    assert thinking_chat(client, thinking_token_budget=-1).token_ids == free.token_ids


def test_completions_take_the_budget_too(client, default_tokenizer, end):
    prompt = default_tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False
    )
    completion = client.completions.create(
        model=MODEL,
        prompt=prompt + "<think>",
        temperature=0,
        max_tokens=MAX_OUTPUT,
        extra_body={"thinking_token_budget": 0, "return_token_ids": True},
    )
    assert completion.choices[0].token_ids[:3] == end


def test_anthropic_budget_tokens_bound_the_thinking(server, client, default_tokenizer, end):
    """``thinking.budget_tokens`` is chat's ``thinking_token_budget``: a prefill that has
    thought for 1020 tokens of a 1024 budget gets 4 more, then the end."""
    thought = " step" * 1020
    messages = [*QUESTION, {"role": "assistant", "content": "<think>" + thought}]
    prompt = default_tokenizer.apply_chat_template(
        messages, continue_final_message=True, add_generation_prompt=False, tokenize=False
    )
    assert prompt.endswith(thought)
    anthropic_client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    message = anthropic_client.messages.create(
        model=MODEL,
        messages=messages,
        max_tokens=1100,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    )
    expected = thinking_chat(client, thought, thinking_token_budget=1024)
    assert expected.token_ids[4:7] == end
    assert message.content[-1].type == "text"
    assert message.content[-1].text == expected.message.content
    unbounded = thinking_chat(client, thought)
    assert unbounded.token_ids[:4] == expected.token_ids[:4]
    assert unbounded.message.content is None


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
@pytest.mark.parametrize("value", [-5, 1.5, True, "3"])
def test_bad_budgets_are_400s_naming_the_field(client, path, value):
    body = {"model": MODEL, "max_tokens": 2, "thinking_token_budget": value}
    body |= {"messages": QUESTION} if path == "/chat/completions" else {"prompt": "Hi"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post(path, body=body, cast_to=object)
    assert refused.value.status_code == 400
    assert refused.value.body == {
        "message": "thinking_token_budget: must be an integer >= 0, or -1 for no limit, got "
        f"{value!r}",
        "type": "BadRequestError",
        "param": "thinking_token_budget",
        "code": 400,
    }


def test_a_budget_the_server_cannot_enforce_is_a_400(unconfigured):
    client = unconfigured.openai_client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=2,
            extra_body={"thinking_token_budget": 8},
        )
    assert refused.value.body == {
        "message": "thinking_token_budget needs the engine to know where a think block starts "
        "and ends: start it with --reasoning-parser and/or --reasoning-config",
        "type": "BadRequestError",
        "param": "thinking_token_budget",
        "code": 400,
    }
    # Without a budget (-1: none) the same server answers.
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"thinking_token_budget": -1}
    )
    assert answer.choices[0].message.content
    # Anthropic's budget is refused the same way, named by its own field.
    anthropic_client = anthropic.Anthropic(
        base_url=unconfigured.url, api_key=API_KEY, max_retries=0
    )
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_client.messages.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=1100,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("thinking.budget_tokens needs the engine to know")
