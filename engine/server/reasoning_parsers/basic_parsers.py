"""Reasoning in a ``<think>`` ... ``</think>`` block (vLLM's ``BaseThinkingReasoningParser``
family), read from the text, so the tags may be single tokens or arrive in pieces:

    <think>The user wants the weather; I should call the tool.</think>It is sunny in Paris.

The output starts inside the block: chat templates of thinking models (DeepSeek-R1, Qwen3)
often open ``<think>`` in the prompt, so the model writes only the rest of it. Everything up to
the first ``</think>`` is reasoning (a ``<think>`` tag there, written by the model itself, is
dropped); everything after it is content, less any further ``<think>`` or ``</think>`` tag (as
vLLM's streamed replies drop them). An output without ``</think>`` is all reasoning, with no
content (the model was cut short, or never closed its thoughts). A constrained output
(``ReasoningParser``'s ``constrained``) is content as it came unless it starts with
``<think>``, and so is every output of a request that turned thinking off.

Streaming sends each piece as soon as it is known to be reasoning or content, and holds back
only text that could be the start of a tag (``partial_tag_length``), so no tag, whole or in
pieces, ever reaches the client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

from kvpilot.engine.server.partial_tags import partial_tag_length
from kvpilot.engine.server.protocol import DeltaMessage
from kvpilot.engine.server.reasoning_parsers.abstract_reasoning_parser import ReasoningParser


class _Part(Enum):
    OPENING = "opening"  # a constrained output's start: is it <think>?
    REASONING = "reasoning"
    ANSWER = "answer"  # after the block: content, its think tags dropped
    CONTENT = "content"  # no block at all: content as it came


class BaseThinkingReasoningParser(ReasoningParser):
    """Splits an output at the end of its ``start_tag`` ... ``end_tag`` block (the rules of
    the module's docstring; vLLM's ``BaseThinkingReasoningParser`` with DeepSeek-R1's start
    inside the block). Works on text: a tag may span several tokens or deltas.

    Subclasses set the tags, ``implicit_end_tags`` and ``thinking_enabled``.

    Args:
        chat_template_kwargs: the request's merged template variables.
        constrained: see ``ReasoningParser``.
    """

    start_tag = "<think>"
    end_tag = "</think>"
    implicit_end_tags: tuple[str, ...] = ()
    """Tags that end the reasoning without ``end_tag`` and begin the content, which keeps them
    (Qwen3's ``<tool_call>``)."""

    def __init__(
        self, chat_template_kwargs: Mapping[str, Any] | None = None, constrained: bool = False
    ) -> None:
        super().__init__(chat_template_kwargs, constrained)
        if not self.thinking_enabled():
            self._part = _Part.CONTENT
        else:
            self._part = _Part.OPENING if constrained else _Part.REASONING
        self._buffer = ""

    def thinking_enabled(self) -> bool:
        """Whether the request lets the model think (default: always); when not, the whole
        output is content, tags included."""
        return True

    def extract_reasoning_streaming(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        """Reasoning up to the end of the block, then content; a possible partial tag waits."""
        self._buffer += delta_text
        if self._part is _Part.OPENING:
            if self._buffer.startswith(self.start_tag):
                self._buffer = self._buffer[len(self.start_tag) :]
                self._part = _Part.REASONING
            elif finished or not self.start_tag.startswith(self._buffer):
                self._part = _Part.CONTENT
            else:
                return None
        reasoning = self._take_reasoning(finished) if self._part is _Part.REASONING else ""
        content = ""
        if self._part is _Part.ANSWER:
            content = self._take_answer(finished)
        elif self._part is _Part.CONTENT:
            content, self._buffer = self._buffer, ""
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)

    def count_reasoning_tokens(
        self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]
    ) -> int:
        """The output's tokens up to the end of its reasoning block, the tag that ends it
        included: the fewest whose text ends the block, found by a binary search over prefixes
        (each decoded as the output was: a tag may span tokens); every token when the block
        never ends; 0 when the output has no reasoning. Counts the same for every tokenizer,
        where vLLM counts the tokens between single-token tags.

        Args:
            token_ids: ``[num_output_tokens]`` the output's token ids.
            decode: the text of a prefix of them (``skip_special_tokens`` as the request's).
        """
        whole = self._fresh()
        whole.extract_reasoning_streaming(decode(token_ids), finished=True)
        if whole._part is _Part.CONTENT:
            return 0
        if whole._part is _Part.REASONING:
            return len(token_ids)
        low, high = 0, len(token_ids)  # the block ends within the first `high` tokens
        while low + 1 < high:
            middle = (low + high) // 2
            prefix = self._fresh()
            prefix.extract_reasoning_streaming(decode(token_ids[:middle]), finished=False)
            if prefix._part is _Part.ANSWER:
                high = middle
            else:
                low = middle
        return high

    def _fresh(self) -> BaseThinkingReasoningParser:
        """A parser in this one's starting state."""
        return type(self)(self.chat_template_kwargs, self.constrained)

    def _take_reasoning(self, finished: bool) -> str:
        """The reasoning in the buffer, taken out of it, up to the tag that ends the block
        (then the part is content); start tags inside are dropped."""
        tags = (self.start_tag, self.end_tag, *self.implicit_end_tags)
        reasoning: list[str] = []
        while self._part is _Part.REASONING:
            found = [(at, tag) for tag in tags if (at := self._buffer.find(tag)) >= 0]
            if not found:
                keep = 0 if finished else max(partial_tag_length(self._buffer, t) for t in tags)
                reasoning.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            at, tag = min(found)
            reasoning.append(self._buffer[:at])
            if tag in self.implicit_end_tags:
                self._buffer = self._buffer[at:]
            else:
                self._buffer = self._buffer[at + len(tag) :]
            if tag != self.start_tag:
                self._part = _Part.ANSWER
        return "".join(reasoning)

    def _take_answer(self, finished: bool) -> str:
        """The content in the buffer, taken out of it, without the block's tags; a possible
        partial tag stays."""
        text = self._buffer.replace(self.start_tag, "").replace(self.end_tag, "")
        keep = 0
        if not finished:
            keep = max(partial_tag_length(text, t) for t in (self.start_tag, self.end_tag))
        self._buffer = text[len(text) - keep :]
        return text[: len(text) - keep]
