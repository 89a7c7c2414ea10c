"""A chat choice's output read as vLLM chains its parsers: the reasoning parser
(``reasoning_parsers``) splits off the model's reasoning, then the tool parser
(``tool_parsers``) reads the calls in the content that remains; whole or in deltas."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.protocol import DeltaMessage, ToolCall
from kvpilot.engine.server.reasoning_parsers import ReasoningParser
from kvpilot.engine.server.tool_parsers import ToolParser


@dataclass
class OutputParsers:
    """How a request's outputs are read, as vLLM chains its parsers: the reasoning parser splits
    off the reasoning, then the tool parser reads the calls in the content that remains.

    Attributes:
        make_reasoning_parser: makes a choice's reasoning parser; None: no reasoning.
        make_tool_parser: makes a choice's tool parser; None: no tool calls.
        include_reasoning: the request's ``include_reasoning``.
    """

    make_reasoning_parser: Callable[[], ReasoningParser] | None
    make_tool_parser: Callable[[], ToolParser] | None
    include_reasoning: bool

    @property
    def hides_tokens(self) -> bool:
        """Whether logprobs and token ids stay out of the response: they would show the
        reasoning the request left out (vLLM's rule)."""
        return self.make_reasoning_parser is not None and not self.include_reasoning

    def adjust_request(self, params: SamplingParams) -> None:
        """The reasoning parser's changes to the request's sampling (the tool parser's are
        made before, where its errors become 400s)."""
        if self.make_reasoning_parser is not None:
            self.make_reasoning_parser().adjust_request(params)

    def choice(self) -> ChoiceParser:
        """Fresh parsers for one choice."""
        return ChoiceParser(
            self.make_reasoning_parser() if self.make_reasoning_parser else None,
            self.make_tool_parser() if self.make_tool_parser else None,
            self.include_reasoning,
        )


class ChoiceParser:
    """One choice's reasoning and tool parsers, fed its output whole or in deltas."""

    def __init__(
        self,
        reasoning_parser: ReasoningParser | None,
        tool_parser: ToolParser | None,
        include_reasoning: bool,
    ) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.include_reasoning = include_reasoning

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        """The delta to send for newly generated text (None: nothing yet)."""
        reasoning = None
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.extract_reasoning_streaming(text, finished)
            text = (split.content or "") if split else ""
            reasoning = split.reasoning if split and self.include_reasoning else None
        if self.tool_parser is not None:
            delta = self.tool_parser.extract_tool_calls_streaming(text, finished)
        else:
            delta = DeltaMessage(content=text) if text else None
        if reasoning:
            delta = (delta or DeltaMessage()).model_copy(update={"reasoning": reasoning})
        return delta

    def whole(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, str | None, list[ToolCall] | None, str | None]:
        """``(reasoning, content, tool_calls, finish_reason)`` of a whole output; the content
        is None when the output is all reasoning, or all calls."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning(text)
            reasoning = reasoning if self.include_reasoning else None
        tool_calls = None
        if self.tool_parser is not None and content is not None:
            extracted = self.tool_parser.extract_tool_calls(content)
            content, tool_calls = extracted.content, extracted.tool_calls or None
        return reasoning, content, tool_calls, self.finish_reason(finish_reason)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """``tool_calls`` for an output that ended normally after making calls."""
        if self.tool_parser is None:
            return finish_reason
        return self.tool_parser.finish_reason(finish_reason)
