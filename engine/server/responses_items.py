"""The Responses API's items: ``input`` items read into chat messages, and a chat reply's
reasoning, text and tool calls written as ``output`` items (``reasoning``, ``message``,
``function_call``), as vLLM converts them for text models."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from kvpilot.engine.server.protocol import ToolCall

TEXT_PARTS = ("input_text", "output_text", "text")
"""Content part types whose ``text`` is read (``text``: chat's own name)."""
MESSAGE_ROLES = ("user", "system", "developer", "assistant")


def item_id(prefix: str) -> str:
    """An item id like OpenAI's: ``msg_<hex>``, ``rs_<hex>``, ``fc_<hex>``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(
    instructions: str | None,
    items: str | Sequence[dict[str, Any]],
    history: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The chat conversation of a request.

    Args:
        instructions: a system message put first, if any.
        items: the request's ``input``: a string is one user message; a list holds messages
            (``{"role", "content"}``, ``type`` ``"message"`` or absent; content a string or a
            list of ``input_text``/``output_text`` parts, which chat joins one a line), ``function_call`` items (merged
            into the assistant message before them, as its ``tool_calls``),
            ``function_call_output`` items (``tool`` messages) and ``reasoning`` items (the
            ``reasoning`` of the assistant turn they open, for templates that render it).
        history: an earlier response's conversation (``previous_response_id``): its messages
            come before ``items``, without its system messages (instructions do not carry
            over, as OpenAI's rule).

    Returns:
        Chat messages (dicts as ``ChatCompletionRequest.messages`` takes them).

    Raises:
        ValueError: ``input: ...`` naming the item that is not a dict, has an unknown
            ``type`` or role, content that is not text, encrypted reasoning, or misses a field
            it needs; or when no item is a message or call to answer.
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(dict(m) for m in history if m.get("role") != "system")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    answered = False  # whether an item other than reasoning came
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"input: item {i} must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        answered = answered or kind != "reasoning"
        if kind == "message":
            _add_message(messages, _message(i, item))
        elif kind == "function_call":
            _add_call(messages, _function_call(i, item))
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(i, item, "call_id"),
                    "content": _output(i, item.get("output")),
                }
            )
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:
                raise ValueError(f"input: item {i}: encrypted reasoning content is not supported")
            if text := _reasoning_text(item):
                messages.append({"role": "assistant", "content": None, "reasoning": text})
        else:
            raise ValueError(
                f"input: item {i} has type {kind!r}: supported are 'message', 'function_call', "
                "'function_call_output' and 'reasoning'"
            )
    if not answered:
        raise ValueError("input: holds no message to answer, only reasoning")
    return messages


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary (vLLM's
    order)."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts and isinstance(parts[0], dict):
            text = parts[0].get("text")
            if isinstance(text, str):
                return text
    return ""


def _add_message(messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
    """An assistant message completes the reasoning before it (one turn, as vLLM merges
    them); any other message comes on its own."""
    last = messages[-1] if messages else None
    if (
        message["role"] == "assistant"
        and last is not None
        and last["role"] == "assistant"
        and last.get("content") is None
        and not last.get("tool_calls")
    ):
        last["content"] = message["content"]
    else:
        messages.append(message)


PARTIAL = ("in_progress", "incomplete")
"""Statuses of an assistant message that a request continues (vLLM's rule)."""


def continues_final_message(items: str | Sequence[dict[str, Any]]) -> bool:
    """Whether the input ends with a partial assistant message (``status`` ``"in_progress"`` or
    ``"incomplete"``), which the reply continues instead of starting a new turn, as vLLM
    continues it (chat's ``continue_final_message``)."""
    if isinstance(items, str) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    is_message = last.get("type", "message") == "message" and last.get("role") == "assistant"
    return is_message and last.get("status") in PARTIAL


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise ValueError(
            f"input: item {i} has role {role!r}: must be one of {', '.join(MESSAGE_ROLES)}"
        )
    return {"role": role, "content": _content(i, item.get("content"), "content")}


def _content(i: int, content: Any, key: str) -> str | list[dict[str, str]]:
    """A string, or the text parts as chat's (``{"type": "text", "text"}``, which chat joins
    one a line, or hands to an ``openai``-format template as they are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input: item {i} needs {key!r}, a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(
                f"input: item {i}, {key} part {j} (type {kind!r}) is not supported: only "
                "text parts (input_text, output_text) with a string 'text' are"
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _output(i: int, output: Any) -> str | list[dict[str, str]]:
    """A ``function_call_output``'s ``output``: a string, or text parts."""
    return _content(i, output, "output")


def _string(i: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"input: item {i} ({item.get('type')}) needs a string {key!r}")
    return value


def _function_call(i: int, item: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": _string(i, item, "call_id"),
        "type": "function",
        "function": {"name": _string(i, item, "name"), "arguments": _string(i, item, "arguments")},
    }


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A call goes into the assistant message it follows (one message may make several)."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def output_items(
    reasoning: str | None,
    content: str | None,
    tool_calls: Sequence[ToolCall] | None,
    logprobs: list[dict[str, Any]] | None = None,
    cut: bool = False,
) -> list[dict[str, Any]]:
    """A whole reply as ``output`` items: its reasoning, its text, its calls (each present).

    Args:
        reasoning: the reasoning the server's parser split off, or None.
        content: the reply's text, or None.
        tool_calls: the calls read from the reply.
        logprobs: the text's token logprobs (``OUTPUT_LOGPROBS``), or None.
        cut: the output limit cut the reply: its last item is ``"incomplete"``, as OpenAI
            marks it.
    """
    items = []
    if reasoning:
        items.append(reasoning_item(item_id("rs"), reasoning, "completed"))
    if content:
        items.append(message_item(item_id("msg"), content, "completed", logprobs))
    for call in tool_calls or ():
        items.append(
            function_call_item(
                item_id("fc"), call.id, call.function.name, call.function.arguments, "completed"
            )
        )
    if cut and items:
        items[-1]["status"] = "incomplete"
    return items


def reasoning_item(id_: str, text: str | None, status: str) -> dict[str, Any]:
    """A ``reasoning`` item (its text as one ``reasoning_text`` part; none while opening)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": id_, "type": "reasoning", "summary": [], "content": content, "status": status}


def output_text(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(
    id_: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An assistant ``message`` item (its text as one ``output_text`` part; none while
    opening)."""
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": id_, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(
    id_: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    """A ``function_call`` item: ``call_id`` is what a ``function_call_output`` answers."""
    return {
        "id": id_,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's ``output`` as the chat messages a follow-up request continues from: the
    reasoning, text and calls of one assistant message."""
    text = "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in items
        if item["type"] == "function_call"
    ]
    reasoning = "".join(
        part["text"] for item in items if item["type"] == "reasoning" for part in item["content"]
    )
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning"] = reasoning
    return [message] if text or calls or reasoning else []
