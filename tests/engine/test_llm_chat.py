"""``LLM.chat``: conversations through the model's chat template, as vLLM's ``LLM.chat``.

The prompt must be exactly transformers' ``apply_chat_template(..., tokenize=True)`` and the
greedy reply exactly transformers' ``generate()`` on those ids.
"""

from __future__ import annotations

import json

import pytest

from kvpilot.engine import LLM
from tests.engine.helpers import assert_no_leak, greedy, hf_greedy
from tests.tool_use import HERMES_TEMPLATE, TIME, WEATHER

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Another "}, {"type": "text", "text": "one?"}],
        },
    ],
]


def hf_chat_ids(tokenizer, conversation, **kwargs) -> list[int]:
    """transformers' own rendering of a conversation (text parts one a line, as vLLM joins
    them)."""
    flat = [
        {
            **m,
            "content": m["content"]
            if isinstance(m["content"], str)
            else "\n".join(p["text"] for p in m["content"]),
        }
        for m in conversation
    ]
    return list(tokenizer.apply_chat_template(flat, tokenize=True, **kwargs)["input_ids"])


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir("llama")), max_model_len=256)


@pytest.mark.slow
def test_default_model_chat_matches_transformers(default_model_dir):
    llm = LLM(max_model_len=512)
    tokenizer = llm.get_tokenizer()
    outputs = llm.chat(CONVERSATIONS, greedy(max_tokens=24), use_tqdm=False)
    expected_prompts = [
        hf_chat_ids(tokenizer, c, add_generation_prompt=True) for c in CONVERSATIONS
    ]
    assert [o.prompt_token_ids for o in outputs] == expected_prompts
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(
        default_model_dir, expected_prompts, 24
    )
    # One conversation alone gives the same as in the batch.
    [alone] = llm.chat(CONVERSATIONS[1], greedy(max_tokens=24), use_tqdm=False)
    assert alone.outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert_no_leak(llm.llm_engine)


def test_template_options_match_transformers(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    open_reply = [*CONVERSATIONS[0], {"role": "assistant", "content": "The capital is"}]
    [continued] = tiny_llm.chat(
        open_reply,
        greedy(max_tokens=2),
        add_generation_prompt=False,
        continue_final_message=True,
        use_tqdm=False,
    )
    assert continued.prompt_token_ids == hf_chat_ids(
        tokenizer, open_reply, continue_final_message=True
    )
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    [custom] = tiny_llm.chat(
        CONVERSATIONS[0], greedy(max_tokens=2), chat_template=template, use_tqdm=False
    )
    assert custom.prompt_token_ids == tokenizer.encode(
        "[user] What is the capital of France?\n", add_special_tokens=False
    )
    batch = tiny_llm.chat(
        CONVERSATIONS, [greedy(max_tokens=1), greedy(max_tokens=3)], use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in batch] == [1, 3]


def test_developer_messages_are_system_ones_for_a_template_without_that_role(tiny_llm):
    # As vLLM: OpenAI's "developer" role becomes "system" unless the template names it, and
    # the system messages then go first, merged.
    tokenizer = tiny_llm.get_tokenizer()
    user = {"role": "user", "content": "hi"}

    def prompt(conversation, **kwargs):
        [out] = tiny_llm.chat(conversation, greedy(max_tokens=1), use_tqdm=False, **kwargs)
        return out.prompt_token_ids

    developer = [{"role": "developer", "content": "Be brief."}, user]
    assert prompt(developer) == hf_chat_ids(
        tokenizer, [{"role": "system", "content": "Be brief."}, user], add_generation_prompt=True
    )
    late = [{"role": "system", "content": "S."}, user, {"role": "developer", "content": "D."}]
    assert prompt(late) == hf_chat_ids(
        tokenizer, [{"role": "system", "content": "S.\n\nD."}, user], add_generation_prompt=True
    )
    knows_it = "{% for m in messages %}{% if m.role == 'developer' %}DEV {% endif %}{{ m.content }}\n{% endfor %}"
    assert prompt(developer, chat_template=knows_it) == tokenizer.encode(
        "DEV Be brief.\nhi\n", add_special_tokens=False
    )


def test_tools_reach_the_template_as_transformers_renders_them(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    tools = [WEATHER, TIME]
    [output] = tiny_llm.chat(
        CONVERSATIONS[0],
        greedy(max_tokens=1),
        tools=tools,
        chat_template=HERMES_TEMPLATE,
        use_tqdm=False,
    )
    assert output.prompt_token_ids == hf_chat_ids(
        tokenizer,
        CONVERSATIONS[0],
        tools=tools,
        add_generation_prompt=True,
        chat_template=HERMES_TEMPLATE,
    )
    prompt = tokenizer.decode(output.prompt_token_ids)
    assert f"<tools>{json.dumps(WEATHER)}{json.dumps(TIME)}</tools>" in prompt
    [plain] = tiny_llm.chat(
        CONVERSATIONS[0], greedy(max_tokens=1), chat_template=HERMES_TEMPLATE, use_tqdm=False
    )
    assert "<tools>" not in tokenizer.decode(plain.prompt_token_ids)


def test_chat_template_kwargs_win_over_the_arguments_of_the_same_name(tiny_llm):
    # vLLM's merge: a template variable in chat_template_kwargs over the argument.
    tokenizer = tiny_llm.get_tokenizer()
    [output] = tiny_llm.chat(
        CONVERSATIONS[0],
        greedy(max_tokens=1),
        add_generation_prompt=True,
        chat_template_kwargs={"add_generation_prompt": False},
        use_tqdm=False,
    )
    assert output.prompt_token_ids == hf_chat_ids(
        tokenizer, CONVERSATIONS[0], add_generation_prompt=False
    )
    with pytest.raises(ValueError, match="chat_template_kwargs: 'tokenize' cannot be set here"):
        tiny_llm.chat(CONVERSATIONS[0], chat_template_kwargs={"tokenize": True}, use_tqdm=False)


def test_a_model_without_chat_template_is_refused(tiny_llm, monkeypatch):
    monkeypatch.setattr(tiny_llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ValueError, match="messages: the model has no chat template"):
        tiny_llm.chat(CONVERSATIONS[0], use_tqdm=False)


@pytest.mark.parametrize(
    ("messages", "kwargs", "message"),
    [
        ([], {}, "messages: must be a conversation"),
        ([{"content": "no role"}], {}, "messages: message 0 needs a string 'role'"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "messages: message 0 content"),
        (CONVERSATIONS[0], {"continue_final_message": True}, "continue_final_message"),
        (CONVERSATIONS[0], {"chat_template": "{{ raise_exception('no') }}"}, "refused them: no"),
        ([{"role": "user", "content": "\ud800"}], {}, "messages: the text is not valid Unicode"),
        (CONVERSATIONS[0], {"tools": WEATHER}, "tools: must be a list of function tools"),
        (CONVERSATIONS[0], {"tools": ["get_weather"]}, "tools: tool 0 must be a dict, got str"),
        (
            CONVERSATIONS[0],
            {"tools": [WEATHER, {"type": "code_interpreter"}]},
            "tools: tool 1 has type 'code_interpreter'",
        ),
        (CONVERSATIONS[0], {"tools": [{"function": {}}]}, "tools: tool 0 needs a function"),
        (
            CONVERSATIONS[0],
            {"tools": [{"function": {"name": "f", "parameters": "{}"}}]},
            "tools: the parameters of function 'f' must be a JSON object",
        ),
        (CONVERSATIONS[0], {"tools": [TIME, TIME]}, "tools: function names must be unique"),
    ],
)
def test_bad_conversations_are_refused_by_name(tiny_llm, messages, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.chat(messages, greedy(max_tokens=1), use_tqdm=False, **kwargs)
    assert_no_leak(tiny_llm.llm_engine)
