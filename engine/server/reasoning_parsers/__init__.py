"""Reasoning on ``/v1/chat/completions``, as vLLM's ``--reasoning-parser`` does it: the text a
thinking model writes before its answer comes back as ``message.reasoning`` (streamed as
``delta.reasoning``), the answer as ``content``; tool calls are read from the content only.

Imports nothing heavy: the command line lists ``REASONING_PARSERS`` as the flag's choices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.reasoning_parsers.abstract_reasoning_parser import ReasoningParser
from kvpilot.engine.server.reasoning_parsers.basic_parsers import BaseThinkingReasoningParser
from kvpilot.engine.server.reasoning_parsers.deepseek_r1_reasoning_parser import (
    DeepSeekR1ReasoningParser,
)
from kvpilot.engine.server.reasoning_parsers.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = [
    "REASONING_PARSERS",
    "BaseThinkingReasoningParser",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "get_reasoning_parser",
]

# --reasoning-parser names (vLLM's) -> parser.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(
    name: str | None, chat_template_kwargs: Mapping[str, Any] | None, params: SamplingParams
) -> Callable[[], ReasoningParser] | None:
    """What makes a request's reasoning parsers (call it once per choice).

    Args:
        name: the server's ``--reasoning-parser`` (a ``REASONING_PARSERS`` name), or None.
        chat_template_kwargs: the request's merged template variables.
        params: the request's sampling, with the tool parser's changes made: an output
            constrained by structured outputs is parsed as such (``ReasoningParser``).

    Returns:
        None without a reasoning parser: the output is all content.
    """
    if name is None:
        return None
    constrained = params.structured_outputs is not None
    return functools.partial(REASONING_PARSERS[name], chat_template_kwargs, constrained)
