"""A streamed response's Server-Sent Events, in the order OpenAI's Responses API sends them.

``response.created`` and ``response.in_progress`` open the stream; each output item then comes
as ``response.output_item.added``, its deltas, and its ``.done`` events
(``response.output_item.done`` last); ``response.completed`` carries the whole response
(``status`` ``"incomplete"`` when the output was cut, as vLLM sends it). For a
``message``: ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``; for a ``reasoning`` item the same
with ``reasoning_text``; for a ``function_call``: ``response.function_call_arguments.delta``...
and ``.done``. Every event has ``type`` and a ``sequence_number`` counting from 0; each is
written as ``event: <type>`` and ``data: <json>``, as vLLM and OpenAI send them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.server.protocol import DeltaMessage, DeltaToolCall
from kvpilot.engine.server.responses_items import (
    function_call_item,
    item_id,
    message_item,
    output_text,
    reasoning_item,
)
from kvpilot.engine.server.responses_protocol import ResponsesResponse
from kvpilot.engine.server.serving_engine import named_sse


@dataclass
class _OpenItem:
    """The output item being streamed."""

    kind: str  # "reasoning", "message" or "function_call"
    id: str
    output_index: int
    text: str = ""  # the text, or a call's arguments, so far
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_index: int | None = None  # a call's index among the reply's calls
    call_id: str = ""
    name: str = ""


class ResponseEvents:
    """Writes one response's events from chat deltas (``output_parsers.ChoiceParser.delta``).

    Attributes:
        items: the output items closed so far (their final form, as ``response.completed``
            lists them).
    """

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []
        self._open: _OpenItem | None = None
        self._pending_logprobs: list[dict[str, Any]] = []

    def event(self, type_: str, **fields: Any) -> str:
        """One event, numbered."""
        body = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return named_sse(type_, body)

    def start(self, response: ResponsesResponse) -> list[str]:
        """``response.created`` and ``response.in_progress`` for the response in progress."""
        snapshot = response.model_dump()
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def delta(self, delta: DeltaMessage, logprobs: list[dict[str, Any]]) -> list[str]:
        """The events of one delta of the reply.

        Args:
            delta: newly generated reasoning, text and/or tool call pieces.
            logprobs: the logprobs of the text's tokens behind it (empty unless asked for):
                sent with the next text delta.
        """
        self._pending_logprobs.extend(logprobs)
        events = []
        if delta.reasoning:
            events += self._switch("reasoning")
            events += self._text_delta("response.reasoning_text.delta", delta.reasoning)
        if delta.content:
            events += self._switch("message")
            events += self._text_delta("response.output_text.delta", delta.content)
        for call in delta.tool_calls or ():
            events += self._call_delta(call)
        return events

    def close(self, status: str = "completed") -> list[str]:
        """The ``.done`` events of the open item, if any; ``status`` ``"incomplete"`` for one
        the output limit cut."""
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.output_index}
        if item.kind == "function_call":
            done = function_call_item(item.id, item.call_id, item.name, item.text, status)
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.name,
                    arguments=item.text,
                )
            ]
        else:
            if item.kind == "reasoning":
                done = reasoning_item(item.id, item.text, status)
                text_done = self.event(
                    "response.reasoning_text.done", **where, content_index=0, text=item.text
                )
            else:
                item.logprobs += self._pending_logprobs
                self._pending_logprobs = []
                done = message_item(item.id, item.text, status, item.logprobs)
                text_done = self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=item.text,
                    logprobs=item.logprobs,
                )
            part_done = self.event(
                "response.content_part.done", **where, content_index=0, part=done["content"][0]
            )
            events = [text_done, part_done]
        self.items.append(done)
        events.append(
            self.event("response.output_item.done", output_index=item.output_index, item=done)
        )
        return events

    def completed(self, response: ResponsesResponse) -> str:
        """``response.completed`` with the whole response, whatever its ``status`` (as vLLM
        sends it, and as the ``openai`` client's stream helper waits for it; OpenAI sends
        ``response.incomplete`` for an incomplete one)."""
        return self.event("response.completed", response=response.model_dump())

    def error(self, message: str, code: int) -> str:
        """An ``error`` event: the response failed after the stream began."""
        return self.event("error", code=str(code), message=message, param=None)

    def _switch(self, kind: str) -> list[str]:
        """Open an item of ``kind`` unless one is open (closing the other one first)."""
        if self._open is not None and self._open.kind == kind:
            return []
        events = self.close()
        prefix = "rs" if kind == "reasoning" else "msg"
        self._open = item = _OpenItem(kind, item_id(prefix), len(self.items))
        if kind == "reasoning":
            added = reasoning_item(item.id, None, "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            added = message_item(item.id, None, "in_progress")
            part = output_text("", None)
        where = {"item_id": item.id, "output_index": item.output_index}
        events.append(
            self.event("response.output_item.added", output_index=item.output_index, item=added)
        )
        events.append(
            self.event("response.content_part.added", **where, content_index=0, part=part)
        )
        return events

    def _text_delta(self, type_: str, text: str) -> list[str]:
        item = self._open
        item.text += text
        fields = {}
        if item.kind == "message":
            fields["logprobs"] = self._pending_logprobs
            item.logprobs += self._pending_logprobs
            self._pending_logprobs = []
        return [
            self.event(
                type_,
                item_id=item.id,
                output_index=item.output_index,
                content_index=0,
                delta=text,
                **fields,
            )
        ]

    def _call_delta(self, call: DeltaToolCall) -> list[str]:
        events = []
        item = self._open
        if item is None or item.kind != "function_call" or item.call_index != call.index:
            events = self.close()
            name = call.function.name if call.function and call.function.name else ""
            self._open = item = _OpenItem(
                "function_call",
                item_id("fc"),
                len(self.items),
                call_index=call.index,
                call_id=call.id or item_id("call"),
                name=name,
            )
            added = function_call_item(item.id, item.call_id, name, "", "in_progress")
            events.append(
                self.event("response.output_item.added", output_index=item.output_index, item=added)
            )
        arguments = call.function.arguments if call.function else None
        if arguments:
            item.text += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=item.output_index,
                    delta=arguments,
                )
            )
        return events
