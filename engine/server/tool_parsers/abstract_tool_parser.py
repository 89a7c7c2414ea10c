"""The tool parser interface (vLLM's ``ToolParser``): a choice's generated text becomes
OpenAI ``tool_calls`` and the ``content`` around them, streamed or whole."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kvpilot.engine.server.serving_engine import new_request_id


@dataclass
class ExtractedToolCallInformation:
    """A whole output split into tool calls and the text around them.

    Attributes:
        tools_called: whether any call was found.
        tool_calls: the calls, in the order generated.
        content: the text outside the calls; None when calls were found and nothing but
            whitespace surrounds them (``ToolParser.stream_content``).
    """

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


class ToolParser:
    """Extracts tool calls from one choice's output.

    One instance per choice: ``extract_tool_calls_streaming`` keeps state between deltas, and
    ``extract_tool_calls`` feeds it the whole output at once, so a streamed and a whole response
    always agree: the deltas of any split of the output, joined (``merge_deltas``), are the
    whole output's calls and content. Parsers that find content pass it through
    ``stream_content``, which gives whitespace around calls the same treatment in both.

    Args:
        parallel_tool_calls: when False, only the first call is kept (as vLLM filters them).
    """

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        self.parallel_tool_calls = parallel_tool_calls
        self.num_tool_calls = 0
        self._held_whitespace = ""
        self._content_started = False

    @property
    def tools_called(self) -> bool:
        """Whether a call has been emitted."""
        return self.num_tool_calls > 0

    keeps_special_tokens = False
    """Whether the calls are marked by special tokens (``<tool_call>``, ``<|python_tag|>``,
    ``[TOOL_CALLS]``) the parser must see in the text; skipping them would hide the calls (vLLM
    keeps them too)."""

    def adjust_request(self, params: SamplingParams) -> None:
        """Change the request's sampling before it is submitted (default: keep special tokens
        in the text where ``keeps_special_tokens``)."""
        if self.keeps_special_tokens:
            params.skip_special_tokens = False

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        """The delta to send for newly generated text.

        Args:
            delta_text: text generated since the last call.
            finished: the output is complete: flush whatever is held back.

        Returns:
            ``content`` and/or ``tool_calls`` pieces, or None when nothing is ready yet.
        """
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        """Split a whole output into calls and content."""
        return merge_deltas([self.extract_tool_calls_streaming(model_output, finished=True)])

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """OpenAI's ``tool_calls`` for an output that ended normally after making calls."""
        return "tool_calls" if self.tools_called and finish_reason == "stop" else finish_reason

    def stream_content(self, text: str, finished: bool) -> str:
        """The part of newly found content to send now.

        An output whose calls have nothing but whitespace around them has no content (OpenAI's
        ``content: null``), which is known only at the end; so whitespace is held back until
        content that is not whitespace follows (then both go out, and all later content goes
        out at once), and at the end it is sent when no call was made and dropped otherwise.
        Only leading whitespace waits: text streams as soon as it has a visible character.

        Args:
            text: content found in the latest delta (outside any call).
            finished: the output is complete; calls found in it must already be counted.
        """
        if self._content_started:
            return text
        self._held_whitespace += text
        if self._held_whitespace.strip():
            self._content_started = True
        elif not finished or self.tools_called:
            return ""
        text, self._held_whitespace = self._held_whitespace, ""
        return text

    def start_tool_call(self, name: str, arguments: str) -> DeltaToolCall | None:
        """The first piece of a new call, with a fresh ``chatcmpl-tool-<hex>`` id; None when
        parallel tool calls are off and a call was already made."""
        if self.tools_called and not self.parallel_tool_calls:
            return None
        call = DeltaToolCall(
            index=self.num_tool_calls,
            id=new_request_id("chatcmpl-tool"),
            type="function",
            function=DeltaFunctionCall(name=name, arguments=arguments),
        )
        self.num_tool_calls += 1
        return call


def merge_deltas(deltas: Iterable[DeltaMessage | None]) -> ExtractedToolCallInformation:
    """Join streamed deltas into a whole message, as a client does: contents concatenated,
    each call's argument pieces joined (pieces of one call share its ``index``); the content is
    None when calls were found and no delta carried content."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta is None:
            continue
        content.append(delta.content or "")
        for piece in delta.tool_calls or []:
            arguments = piece.function.arguments or "" if piece.function else ""
            if piece.index in calls:
                calls[piece.index].function.arguments += arguments
            else:
                calls[piece.index] = ToolCall(
                    id=piece.id or "",
                    function=FunctionCall(name=piece.function.name or "", arguments=arguments),
                )
    text = "".join(content)
    if calls and not text:
        return ExtractedToolCallInformation(True, list(calls.values()), None)
    return ExtractedToolCallInformation(bool(calls), list(calls.values()), text)


def json_call(value: Any) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of a decoded tool-call object, ``{"name": ...,
    "arguments": {...}}`` (or Llama's ``"parameters"``), or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)
