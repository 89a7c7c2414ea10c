"""The ``hermes`` tool parser (vLLM's ``Hermes2ProToolParser``): calls are JSON objects between
``<tool_call>`` and ``</tool_call>``, as Hermes 2 Pro, Qwen2.5 and Qwen3 write them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the blocks is ``content`` (none when only whitespace surrounds the calls); a
block whose JSON does not parse (or lacks a ``name``, or whose ``arguments`` is not an object)
stays text. A block still open when the output ends is parsed as if closed (the model stopped
at EOS). Streaming holds a block back until it closes and then sends the whole call in one
delta; text that could be the start of ``<tool_call>`` is held back too, so a tag split across
tokens never leaks into ``content``, and so is leading whitespace, until it is known whether it
is content (``ToolParser.stream_content``).
"""

from __future__ import annotations

import json
from typing import Any

from kvpilot.engine.server.partial_tags import partial_tag_length
from kvpilot.engine.server.protocol import DeltaMessage, DeltaToolCall
from kvpilot.engine.server.tool_parsers.abstract_tool_parser import ToolParser

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class Hermes2ProToolParser(ToolParser):
    """Extracts ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._buffer = ""
        self._in_call = False

    keeps_special_tokens = True  # <tool_call> is one in Hermes and Qwen vocabularies

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        """Content up to the next possible tag, and each call once its block closes."""
        self._buffer += delta_text
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if finished else partial_tag_length(self._buffer, TOOL_CALL_START)
                    content.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(TOOL_CALL_START) :]
                self._in_call = True
                continue
            end = self._buffer.find(TOOL_CALL_END)
            if end < 0 and not finished:
                break
            stop = len(self._buffer) if end < 0 else end + len(TOOL_CALL_END)
            block, body = self._buffer[:stop], self._buffer[: stop if end < 0 else end]
            self._buffer = self._buffer[stop:]
            self._in_call = False
            parsed = _parse_call(body)
            if parsed is None:
                content.append(TOOL_CALL_START + block)
            elif (call := self.start_tool_call(*parsed)) is not None:
                calls.append(call)
        text = self.stream_content("".join(content), finished)
        if not text and not calls:
            return None
        return DeltaMessage(content=text or None, tool_calls=calls or None)


def _parse_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of a block, or None when it is not a valid call."""
    try:
        call: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)
