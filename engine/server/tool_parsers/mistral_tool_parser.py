"""The ``mistral`` tool parser (vLLM's ``MistralToolParser``): Mistral models write their tool
calls after the ``[TOOL_CALLS]`` token, in one of two forms by tokenizer version:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (v3, v7)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}    (v11 on)

(an optional ``[CALL_ID]id`` after the name is skipped). Text before the first ``[TOOL_CALLS]``
is content, streamed as it comes but for what could be the start of the tag; each call is sent
whole once its JSON closes. What follows the calls and is none (text, an unclosed object at the
output's end) is content, as it came.
"""

from __future__ import annotations

import json

from kvpilot.engine.server.partial_tags import partial_tag_length
from kvpilot.engine.server.protocol import DeltaMessage, DeltaToolCall
from kvpilot.engine.server.tool_parsers.abstract_tool_parser import ToolParser, json_call

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_DECODER = json.JSONDecoder()


class MistralToolParser(ToolParser):
    """Extracts the calls after ``[TOOL_CALLS]`` (a JSON array, or ``name[ARGS]{...}`` runs)."""

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._buffer = ""
        self._in_calls = False
        self._pending: list[tuple[str, str]] = []  # calls decoded from an array, not sent yet

    keeps_special_tokens = True  # [TOOL_CALLS] is one

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        """Content up to ``[TOOL_CALLS]``, then each call once its JSON closes."""
        self._buffer += delta_text
        content = ""
        if not self._in_calls:
            start = self._buffer.find(TOOL_CALLS)
            if start < 0:
                keep = 0 if finished else partial_tag_length(self._buffer, TOOL_CALLS)
                content = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
            else:
                content, self._buffer = self._buffer[:start], self._buffer[start:]
                self._in_calls = True
        calls: list[DeltaToolCall] = []
        if self._in_calls:
            while (parsed := self._next_call()) is not None:
                if (call := self.start_tool_call(*parsed)) is not None:
                    calls.append(call)
            if finished:
                content, self._buffer = content + self._buffer.strip(), ""
        text = self.stream_content(content, finished)
        if not text and not calls:
            return None
        return DeltaMessage(content=text or None, tool_calls=calls or None)

    def _next_call(self) -> tuple[str, str] | None:
        """The next whole call, taken out of the buffer; None when it is not complete yet or
        is no call (then left in the buffer: content at the end)."""
        if self._pending:
            return self._pending.pop(0)
        rest = self._buffer.lstrip()
        if rest.startswith(TOOL_CALLS):
            rest = rest[len(TOOL_CALLS) :].lstrip()
        if rest.startswith("["):
            try:
                value, end = _DECODER.raw_decode(rest)
            except ValueError:
                return None
            calls = [json_call(item) for item in value] if isinstance(value, list) else [None]
            if not calls or None in calls:
                return None
            self._buffer, self._pending = rest[end:], calls[1:]
            return calls[0]
        name, found, after = rest.partition(ARGS)
        name = name.partition(CALL_ID)[0].strip()
        if not found or not name or any(c.isspace() or c in "[]{}" for c in name):
            return None
        try:
            arguments, end = _DECODER.raw_decode(after)
        except ValueError:
            return None
        call = json_call({"name": name, "arguments": arguments})
        if call is None:
            return None
        self._buffer = after[end:]
        return call
