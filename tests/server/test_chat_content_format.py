"""``--chat-template-content-format``'s pieces without a server: vLLM's ``auto`` detection of the
format a chat template expects (``chat_content_format.detect_content_format``), how ``string`` and
``openai`` shape message content, and the server's merge of ``--default-chat-template-kwargs``
and ``--exclude-tools-when-tool-choice-none`` into a request's template arguments."""

from __future__ import annotations

import pytest

from kvpilot.engine.chat_content_format import detect_content_format, resolve_content_format
from kvpilot.engine.server.protocol import ChatCompletionRequest
from kvpilot.engine.server.serving_chat import chat_template_arguments
from kvpilot.engine.tokenization import (
    apply_chat_template,
    developer_as_system,
    parse_chat_messages,
)
from tests.tool_use import WEATHER

STRING_LOOP = "{% for m in messages %}{{ m.role }}: {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
        # Through a copy of the conversation, a slice, a test and a filter.
        "{% set ms = messages[1:] %}{% for m in ms %}{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}",
        # A macro given the content.
        "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
        "{% macro show(x, c=none) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(1, c=m['content']) }}{% endfor %}",
        # A variable named content.
        "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p }}"
        "{% endfor %}{% endfor %}",
    ],
)
def test_templates_that_loop_over_a_messages_content_expect_openai_parts(template):
    assert detect_content_format(template) == "openai"


@pytest.mark.parametrize(
    "template",
    [
        STRING_LOOP,
        "{% for m in messages %}{% for c in m.tool_calls %}{{ c }}{% endfor %}{% endfor %}",
        "{% macro show(c) %}{% for p in c %}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m.role) }}{% endfor %}",
        "{% for i in range(messages | length) %}{% for p in messages[i]['content'] %}{% endfor %}"
        "{% endfor %}",  # not followed through an index, as in vLLM
        "{% for m in messages %}{{ m.content",  # does not parse
    ],
)
def test_other_templates_expect_strings(template):
    assert detect_content_format(template) == "string"


def test_the_default_models_template_expects_strings(default_tokenizer):
    assert detect_content_format(default_tokenizer.chat_template) == "string"


def test_resolution_picks_the_template_that_renders():
    parts = "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"
    named = {"default": STRING_LOOP, "tool_use": parts}
    assert resolve_content_format("auto", named, has_tools=True) == "openai"
    assert resolve_content_format("auto", named, has_tools=False) == "string"
    assert resolve_content_format("auto", None) == "string"
    assert resolve_content_format("string", parts) == "string"
    assert resolve_content_format("openai", STRING_LOOP) == "openai"
    with pytest.raises(ValueError, match="got 'text'"):
        resolve_content_format("text", STRING_LOOP)


def test_string_joins_text_parts_and_openai_keeps_them():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "c"},
    ]
    assert [m["content"] for m in parse_chat_messages(messages)] == ["a\nb", "", "c"]
    assert [m["content"] for m in parse_chat_messages(messages, "openai")] == [
        [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        [],
        [{"type": "text", "text": "c"}],
    ]
    with pytest.raises(ValueError, match="list of text parts"):
        parse_chat_messages([{"role": "user", "content": [{"type": "image_url"}]}], "openai")


def test_developer_messages_merge_into_one_system_string_in_either_format(default_tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "developer", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
    ]  # fmt: skip
    conversation = developer_as_system(parse_chat_messages(messages, "openai"), STRING_LOOP)
    assert conversation == [
        {"role": "system", "content": "Be\nbrief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    # The default template adds strings to the content: forced OpenAI parts (vLLM's
    # --chat-template-content-format openai) are refused by it, as in vLLM.
    with pytest.raises(ValueError, match="the chat template refused them: can only concatenate"):
        apply_chat_template(default_tokenizer, parse_chat_messages(messages[:1], "openai"))


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **fields)


def test_server_defaults_go_under_the_requests_own_kwargs_as_vllm_merges_them():
    defaults = {"enable_thinking": False, "greeting": "Ahoy"}
    args = chat_template_arguments(request(), defaults)
    assert args["chat_template_kwargs"] == defaults
    own = {"enable_thinking": True, "documents": ["d"]}
    args = chat_template_arguments(request(chat_template_kwargs=own), defaults)
    assert args["chat_template_kwargs"] == {
        "enable_thinking": True,
        "greeting": "Ahoy",
        "documents": ["d"],
    }
    unset = {"enable_thinking": None, "greeting": "auto"}
    args = chat_template_arguments(request(chat_template_kwargs=unset), defaults)
    assert args["chat_template_kwargs"] == defaults
    # The request's own fields are not defaults' to change.
    args = chat_template_arguments(request(add_generation_prompt=False), defaults)
    assert args["add_generation_prompt"] is False


def test_tool_choice_none_drops_the_tools_only_with_the_flag():
    with_tools = request(tools=[WEATHER], tool_choice="none")
    assert chat_template_arguments(with_tools)["tools"] == [WEATHER]
    assert chat_template_arguments(with_tools, None, True)["tools"] is None
    required = request(tools=[WEATHER], tool_choice="required")
    assert chat_template_arguments(required, None, True)["tools"] == [WEATHER]
