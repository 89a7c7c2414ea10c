"""Anthropic's Messages API bodies (``POST /v1/messages``), as vLLM serves them for text models.

A request is read into a chat completion (``MessagesRequest.to_chat_request``): ``system`` and
``messages`` become chat messages (``conversation``: the system prompt first, text blocks as
text parts, ``tool_use`` blocks as the
assistant's ``tool_calls``, ``tool_result`` blocks as ``tool`` messages, ``thinking`` blocks as the
turn's ``reasoning``), ``max_tokens`` the output limit, ``stop_sequences`` the stop strings,
``tools`` chat's function tools (``input_schema`` their parameters), ``tool_choice`` chat's
(``any`` is ``"required"``), ``thinking`` the template's ``enable_thinking`` and, enabled, its
``budget_tokens`` chat's ``thinking_token_budget`` (as vLLM maps it). Field names are
Anthropic's (https://docs.anthropic.com/en/api/messages).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from kvpilot.engine.sampling_params import is_int
from kvpilot.engine.server.protocol import ChatCompletionRequest, OpenAIModel, _SamplingFields
from kvpilot.engine.tokenization import BILLING_HEADER

EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""Anthropic's ``output_config.effort`` values (chat's ``reasoning_effort`` takes them)."""
MIN_THINKING_BUDGET = 1024
"""The least ``thinking.budget_tokens`` Anthropic's API takes."""
CHAT_NAMES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "reasoning_effort": "output_config.effort",
    "response_format": "output_config.format",
    "thinking_token_budget": "thinking.budget_tokens",
}
"""Chat completions' parameter names in errors -> the Messages API's."""
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
"""Anthropic's error ``type`` of each HTTP status (others: ``api_error``)."""


class MessagesRequest(_SamplingFields):
    """``POST /v1/messages`` (and, without ``max_tokens``, ``/v1/messages/count_tokens``).

    Attributes:
        messages: the conversation, alternating ``user`` and ``assistant`` turns; ``content``
            a string or blocks: ``text``, ``tool_use`` (assistant), ``tool_result`` (user),
            ``thinking`` (the turn's ``reasoning``, for templates that render it),
            ``redacted_thinking`` (left out).
        max_tokens: the most tokens to generate (required, as Anthropic's API requires it).
        system: the system prompt: a string or ``text`` blocks.
        stop_sequences: strings that end the output (the one met is ``stop_sequence``).
        temperature, top_p, top_k: sampling (unset: the model's generation config).
        tools: ``{"name", "description", "input_schema"}``.
        tool_choice: ``{"type": "auto" | "any" | "tool" | "none"}`` (``tool`` with ``name``);
            ``disable_parallel_tool_use`` allows one call.
        thinking: ``{"type": "enabled", "budget_tokens"}`` or ``{"type": "disabled"}``: the
            chat template's ``enable_thinking``; ``budget_tokens`` (at least 1024, below
            ``max_tokens``) bounds the think block, as chat's ``thinking_token_budget`` (a 400
            on a server without a reasoning config, as vLLM answers it).
        output_config: ``{"format": {"type": "json_schema", "schema"}, "effort"}``: structured
            output, and the template's ``reasoning_effort``.
        metadata: accepted and unused.
        chat_template_kwargs: vLLM's extra template variables.

    vLLM's extra sampling fields of chat completions (``min_p``, ``seed``,
    ``repetition_penalty``, ``structured_outputs``, ``priority``, ...) are taken too.
    """

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    output_config: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat completion that generates this message.

        Raises:
            ValueError: a block, tool or setting that cannot be read (``messages: ...``,
                ``system: ...``, ``tools: ...``, ``tool_choice: ...``, ``thinking: ...``), or
                what chat completions refuse (``pydantic.ValidationError``).
        """
        body = self.forwarded_fields("stop") | {
            "messages": conversation(self.system, self.messages),
            "max_completion_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "chat_template_kwargs": thinking_kwargs(self.thinking, self.chat_template_kwargs),
            "thinking_token_budget": thinking_token_budget(self.thinking, self.max_tokens),
        }
        if self.output_config is not None:
            body |= output_settings(self.output_config)
        if is_prefill(body["messages"]):
            # Anthropic's prefill: the reply continues the last assistant turn.
            body |= {"add_generation_prompt": False, "continue_final_message": True}
        if self.tools:
            body["tools"] = [chat_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"], parallel = chat_tool_choice(self.tool_choice)
            body["parallel_tool_calls"] = parallel
        return ChatCompletionRequest.model_validate(body)


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a messages request without ``max_tokens``."""

    max_tokens: int | None = None


def is_prefill(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation's last chat message is an assistant's text without calls: an
    Anthropic prefill, which the reply continues."""
    last = messages[-1] if messages else {}
    return last.get("role") == "assistant" and not last.get("tool_calls")


def output_settings(config: dict[str, Any]) -> dict[str, Any]:
    """``output_config`` as chat's ``response_format`` and ``reasoning_effort``.

    Raises:
        ValueError: ``output_config: ...`` for a format other than a JSON schema.
    """
    settings: dict[str, Any] = {}
    effort = config.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise ValueError(f"output_config: effort must be one of {', '.join(EFFORTS)}")
        settings["reasoning_effort"] = effort
    text_format = config.get("format")
    if text_format is not None:
        if not isinstance(text_format, dict) or text_format.get("type") != "json_schema":
            raise ValueError("output_config: format must be {'type': 'json_schema', 'schema': ...}")
        schema = text_format.get("schema")
        settings["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    return settings


def conversation(
    system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Chat messages of a Messages API request: one system message first (``system`` and any
    ``system`` turn among ``messages``, merged as vLLM merges them for chat templates that
    take the system prompt first; Claude Code's ``BILLING_HEADER`` blocks left out), then
    ``chat_messages``.

    Raises:
        ValueError: as ``chat_messages``; ``system: ...`` for blocks other than text.
    """
    if not isinstance(messages, list):
        raise ValueError("messages: must be a list of messages")
    texts = _system_texts(system, "system")
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "system":
            texts += _system_texts(message.get("content"), f"messages: message {i}")
    prompt = "\n".join(t for t in texts if t and not t.startswith(BILLING_HEADER))
    turns = [m for m in messages if not (isinstance(m, dict) and m.get("role") == "system")]
    return ([{"role": "system", "content": prompt}] if prompt else []) + chat_messages(turns)


def _system_texts(system: Any, where: str) -> list[str]:
    if system is None:
        return []
    if isinstance(system, str):
        return [system]
    if not isinstance(system, list):
        raise ValueError(f"{where}: the system prompt must be a string or text blocks")
    return _texts(system, where)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic's conversation as chat messages.

    A user turn's ``tool_result`` blocks become ``tool`` messages, before its text; an
    assistant turn's ``tool_use`` blocks its ``tool_calls`` (``input`` as JSON arguments), its
    ``thinking`` blocks its ``reasoning`` (``redacted_thinking`` is left out).

    Raises:
        ValueError: ``messages: ...`` naming the message and block that cannot be read (a role
            other than user and assistant, an image or document, a block without its fields).
    """
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages: message {i} must be an object")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise ValueError(
                f"messages: message {i} has role {role!r}: must be user, assistant or system"
            )
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages: message {i} needs 'content', a string or a list of blocks")
        parts, calls, thoughts = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages: message {i}, block {j}"
            if kind == "text" and isinstance(block.get("text"), str):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_call(where, block))
            elif kind == "tool_result" and role == "user":
                chat.append(_tool_result(where, block))
            elif kind == "thinking" and role == "assistant":
                thoughts.append(block.get("thinking") or "")
            elif kind == "redacted_thinking" and role == "assistant":
                continue
            else:
                raise ValueError(
                    f"{where} (type {kind!r}) is not supported in a {role} message: supported "
                    "are text, tool_use (assistant), tool_result (user) and thinking (assistant)"
                )
        if not content:
            raise ValueError(f"messages: message {i} has no content blocks")
        if parts or calls or thoughts:
            turn: dict[str, Any] = {"role": role, "content": parts or None}
            if calls:
                turn["tool_calls"] = calls
            if any(thoughts):  # for templates that render earlier reasoning, as vLLM passes it
                turn["reasoning"] = "".join(thoughts)
            chat.append(turn)
    return chat


def _texts(blocks: list[dict[str, Any]], where: str) -> list[str]:
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise ValueError(f"{where}: block {j} must be a text block")
        if not isinstance(block.get("text"), str):
            raise ValueError(f"{where}: block {j} needs a string 'text'")
        texts.append(block["text"])
    return texts


def _tool_call(where: str, block: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise ValueError(f"{where} (tool_use) needs a string 'id' and 'name'")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise ValueError(f"{where} (tool_use) needs 'input', an object")
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": json.dumps(arguments)},
    }


def _tool_result(where: str, block: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise ValueError(f"{where} (tool_result) needs a string 'tool_use_id'")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_texts(content, f"{where} (tool_result) content"))
    if not isinstance(content, str):
        raise ValueError(f"{where} (tool_result) needs 'content', a string or text blocks")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic tool as chat's function tool.

    Raises:
        ValueError: ``tools: ...`` for a server tool (a ``type`` such as ``web_search_…``) or
            one without ``name`` and ``input_schema``.
    """
    if tool.get("type") not in (None, "custom"):
        raise ValueError(
            f"tools: tool {i} has type {tool.get('type')!r}: only client tools (name, "
            "description, input_schema) are supported"
        )
    schema = tool.get("input_schema")
    if not isinstance(tool.get("name"), str) or not isinstance(schema, dict):
        raise ValueError(f"tools: tool {i} needs a string 'name' and an 'input_schema' object")
    if schema.get("type", "object") != "object":
        raise ValueError(f"tools: tool {i}: input_schema must describe an object (type 'object')")
    if not isinstance(tool.get("description", ""), str):
        raise ValueError(f"tools: tool {i}: description must be a string")
    function = {"name": tool["name"], "parameters": schema}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool]:
    """Anthropic's ``tool_choice`` as chat's ``(tool_choice, parallel_tool_calls)``.

    Raises:
        ValueError: ``tool_choice: ...`` for an unknown type, or ``tool`` without a name.
    """
    kind = choice.get("type")
    disable_parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable_parallel, bool):
        raise ValueError("tool_choice: disable_parallel_tool_use must be true or false")
    parallel = not disable_parallel
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ValueError(
        "tool_choice: must be {'type': 'auto' | 'any' | 'none'} or "
        f"{{'type': 'tool', 'name': ...}}; got {choice!r}"
    )


def thinking_kwargs(
    thinking: dict[str, Any] | None, chat_template_kwargs: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The template variables with ``thinking``'s ``enable_thinking`` under the request's own.

    Raises:
        ValueError: ``thinking: ...`` for a type other than enabled, adaptive or disabled.
    """
    if thinking is None:
        return chat_template_kwargs
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise ValueError(
            f"thinking: type must be 'enabled', 'adaptive' or 'disabled', got {kind!r}"
        )
    return {"enable_thinking": kind != "disabled"} | dict(chat_template_kwargs or {})


def thinking_token_budget(thinking: dict[str, Any] | None, max_tokens: int | None) -> int | None:
    """Chat's ``thinking_token_budget`` (tokens) of ``thinking``, as vLLM maps it: an enabled
    thinking's ``budget_tokens``; None otherwise (``thinking_kwargs`` checks the type).

    Args:
        thinking: the request's ``thinking``.
        max_tokens: the request's output limit (tokens); None for a ``count_tokens`` request.

    Raises:
        ValueError: ``thinking: budget_tokens must be an integer of at least 1024``
            (Anthropic's least), ``thinking: budget_tokens ... must be less than max_tokens
            ...`` (vLLM's rule: the answer needs room after the thinking).
    """
    if thinking is None or thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if not is_int(budget) or budget < MIN_THINKING_BUDGET:
        raise ValueError(
            f"thinking: budget_tokens must be an integer of at least {MIN_THINKING_BUDGET}"
        )
    if max_tokens is not None and budget >= max_tokens:
        raise ValueError(
            f"thinking: budget_tokens ({budget}) must be less than max_tokens ({max_tokens})"
        )
    return budget


def stop_reason(finish_reason: str | None, stop: int | str | None, tool_used: bool) -> str | None:
    """Anthropic's ``stop_reason`` of a chat finish reason (after the tool parser's), as vLLM
    maps it: ``max_tokens`` (cut), ``tool_use`` (the calls are complete, or a call was made
    and no stop string was met; a named ``tool_choice`` ends with ``stop``),
    ``stop_sequence`` (a stop string met) or ``end_turn``."""
    if finish_reason is None:
        return None
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "tool_calls":
        return "tool_use"
    if isinstance(stop, str):
        return "stop_sequence"
    return "tool_use" if tool_used else "end_turn"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as a ``tool_use`` block's ``input`` (an object; ``{}`` for
    arguments that are not one, such as a call the output limit cut)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesResponse(OpenAIModel):
    """A whole reply (``type: "message"``): ``content`` blocks (``thinking``, ``text``,
    ``tool_use``), ``stop_reason``, the ``stop_sequence`` met, and the ``usage``
    (``input_tokens``, ``output_tokens``, ``cache_read_input_tokens``: prompt tokens read from
    the prefix cache)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: dict[str, int]
