"""The ``llama3_json`` tool parser (vLLM's ``Llama3JsonToolParser``): Llama 3.1, 3.2 and 3.3
answer a tool call, in their JSON tool-calling format, with nothing but JSON objects, optionally
after the ``<|python_tag|>`` token and separated by ``;``:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

``parameters`` (Llama's name) or ``arguments`` holds the call's arguments. An output that does
not begin (after whitespace) with ``{`` or ``<|python_tag|>`` is plain content, streamed as it
comes; one that does is read object by object, each call sent whole once its object closes.
What follows the last call and is not one (an object without a string ``name``, text that is not
JSON, an object cut off by the output's end) is content, as it came.
"""

from __future__ import annotations

import json

from kvpilot.engine.server.protocol import DeltaMessage, DeltaToolCall
from kvpilot.engine.server.tool_parsers.abstract_tool_parser import ToolParser, json_call

PYTHON_TAG = "<|python_tag|>"
SEPARATORS = " \t\r\n;"
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    """Extracts ``{"name": ..., "parameters": {...}}`` objects from the start of the output."""

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._buffer = ""
        self._mode: str | None = None  # None: undecided; "content" or "calls"

    keeps_special_tokens = True  # <|python_tag|> is one

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        """Content as it comes in a plain answer; in a tool answer, each call once whole."""
        self._buffer += delta_text
        if self._mode is None:
            start = self._buffer.lstrip()
            if start.startswith(("{", PYTHON_TAG)):
                self._mode = "calls"
            elif start and not (PYTHON_TAG.startswith(start) and not finished):
                self._mode = "content"
            elif not finished:
                return None
        calls: list[DeltaToolCall] = []
        content = ""
        if self._mode == "calls":
            while (parsed := self._next_call()) is not None:
                if (call := self.start_tool_call(*parsed)) is not None:
                    calls.append(call)
            if finished:
                content, self._buffer = self._buffer.strip(SEPARATORS), ""
        else:
            content, self._buffer = self._buffer, ""
        text = self.stream_content(content, finished)
        if not text and not calls:
            return None
        return DeltaMessage(content=text or None, tool_calls=calls or None)

    def _next_call(self) -> tuple[str, str] | None:
        """The next whole call at the buffer's start, taken out of it; None when the next
        object is not closed yet, or is no call (left in the buffer: content at the end)."""
        rest = self._buffer.lstrip(SEPARATORS)
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG) :].lstrip(SEPARATORS)
        try:
            value, end = _DECODER.raw_decode(rest)
        except ValueError:
            return None
        call = json_call(value)
        if call is None:
            return None
        self._buffer = rest[end:]
        return call
