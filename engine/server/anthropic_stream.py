"""A streamed Messages API reply's Server-Sent Events, in the order Anthropic sends them.

``message_start`` (the message, empty, with the prompt's usage, sent with the first output);
for each content block ``content_block_start``, its ``content_block_delta`` events
(``thinking_delta``, ``text_delta``, or a ``tool_use`` block's ``input_json_delta`` pieces of
its JSON input), and ``content_block_stop``; then ``message_delta`` (``stop_reason``, ``stop_sequence``, the whole
usage) and ``message_stop``. Each is written as ``event: <type>`` and ``data: <json>``.
"""

from __future__ import annotations

from typing import Any

from kvpilot.engine.server.anthropic_protocol import error_body
from kvpilot.engine.server.protocol import DeltaMessage
from kvpilot.engine.server.serving_engine import named_sse


class MessageEvents:
    """Writes one reply's events from chat deltas (``output_parsers.ChoiceParser.delta``)."""

    def __init__(self) -> None:
        self._index = -1  # the open block's index
        self._open: str | None = None  # its type: "thinking", "text" or "tool_use"
        self._call_index: int | None = None  # an open tool_use block's call index

    @staticmethod
    def event(type_: str, **fields: Any) -> str:
        """One event."""
        return named_sse(type_, {"type": type_, **fields})

    def start(self, message: dict[str, Any]) -> str:
        """``message_start`` with the message so far (no content)."""
        return self.event("message_start", message=message)

    def delta(self, delta: DeltaMessage) -> list[str]:
        """The events of one delta of the reply (reasoning as ``thinking``)."""
        events = []
        if delta.reasoning:
            events += self._switch("thinking", {"thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            events += self._switch("text", {"text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or ():
            if self._open != "tool_use" or self._call_index != call.index:
                name = call.function.name if call.function and call.function.name else ""
                block = {"id": call.id or "", "name": name, "input": {}}
                events += self._switch("tool_use", block, force=True)
                self._call_index = call.index
            arguments = call.function.arguments if call.function else None
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def stop(self, stop_reason: str | None, stop_sequence: str | None, usage: dict) -> list[str]:
        """Close the open block, then ``message_delta`` and ``message_stop``."""
        return [
            *self._close(),
            self.event(
                "message_delta",
                delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage=usage,
            ),
            self.event("message_stop"),
        ]

    def error(self, status: int, message: str) -> str:
        """An ``error`` event: the reply failed after the stream began."""
        return self.event("error", error=error_body(status, message)["error"])

    def _switch(self, kind: str, block: dict[str, Any], force: bool = False) -> list[str]:
        if self._open == kind and not force:
            return []
        events = self._close()
        self._index += 1
        self._open = kind
        events.append(
            self.event(
                "content_block_start", index=self._index, content_block={"type": kind, **block}
            )
        )
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        return self.event("content_block_delta", index=self._index, delta=delta)

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = self._call_index = None
        return [self.event("content_block_stop", index=self._index)]
