"""The conversations the Responses and Messages APIs make for the chat template, rendered by the
default model's tokenizer with a template that shows what it receives: earlier reasoning (under
``reasoning`` and ``reasoning_content``, as vLLM passes it), system prompts without Claude
Code's per-request attribution line, tool calls and results."""

from __future__ import annotations

import pytest

from kvpilot.engine.server.anthropic_protocol import conversation
from kvpilot.engine.server.responses_items import input_messages
from kvpilot.engine.tokenization import apply_chat_template, parse_chat_messages

# Prints each message's role, reasoning (both names), content and calls.
SHOW = (
    "{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content or '' }}|{{ m.reasoning or '' }}"
    "|{{ m.content or '' }}|{% for c in m.tool_calls or [] %}{{ c.function.name }}"
    "{% endfor %}]{% endfor %}"
)
BILLING = "x-anthropic-billing-header: cc_version=2.1; cch=9f3a;"


def rendered(tokenizer, messages) -> str:
    token_ids = apply_chat_template(
        tokenizer, parse_chat_messages(messages), chat_template=SHOW, add_generation_prompt=False
    )
    return tokenizer.decode(token_ids)


def test_responses_reasoning_items_reach_the_template_with_their_turn(default_tokenizer):
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "I should call the tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Sunny it is."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "user", "content": "Thanks!"},
    ]  # fmt: skip
    assert rendered(default_tokenizer, input_messages(BILLING + "\nBe brief.", items)) == (
        "[system|||Be brief.|]"
        "[user|||Weather in Paris?|]"
        "[assistant|I should call the tool.|I should call the tool.||get_weather]"
        "[tool|||sunny|]"
        "[assistant|Sunny it is.|Sunny it is.|It is sunny.|]"
        "[user|||Thanks!|]"
    )


def test_anthropic_thinking_blocks_reach_the_template_with_their_turn(default_tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": ""},
            {"type": "redacted_thinking", "data": "..."},
            {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]},
    ]  # fmt: skip
    system = [{"type": "text", "text": BILLING}, {"type": "text", "text": "Be brief."}]
    assert rendered(default_tokenizer, conversation(system, messages)) == (
        "[system|||Be brief.|]"
        "[user|||Weather in Paris?|]"
        "[assistant|I should call the tool.|I should call the tool.||get_weather]"
        "[tool|||sunny|]"
    )


@pytest.mark.parametrize(
    "content",
    [
        BILLING + "\nBe brief.",
        [{"type": "text", "text": BILLING}, {"type": "text", "text": "Be brief."}],
    ],
)
def test_chat_system_prompts_lose_claude_codes_attribution_line(default_tokenizer, content):
    messages = [{"role": "system", "content": content}, {"role": "user", "content": "Hi"}]
    assert rendered(default_tokenizer, messages) == "[system|||Be brief.|][user|||Hi|]"
