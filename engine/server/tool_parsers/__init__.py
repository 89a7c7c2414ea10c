"""Tool calling on ``/v1/chat/completions``, as vLLM does it: which parser reads a request's
output, chosen by its ``tool_choice``.

- ``"none"`` (or no tools): plain text; the tools are still rendered into the prompt.
- ``"auto"`` (the default with tools): the model writes freely and the server's
  ``--tool-call-parser`` (``TOOL_PARSERS``) finds the calls; needs ``--enable-auto-tool-choice``.
- ``"required"`` or a named function: the output is constrained (``constrained_tool_parsers``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from kvpilot.engine.server.protocol import ChatCompletionRequest
from kvpilot.engine.server.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    merge_deltas,
)
from kvpilot.engine.server.tool_parsers.constrained_tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
)
from kvpilot.engine.server.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from kvpilot.engine.server.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser
from kvpilot.engine.server.tool_parsers.mistral_tool_parser import MistralToolParser
from kvpilot.engine.server.tool_parsers.pythonic_tool_parser import PythonicToolParser

__all__ = [
    "AUTO_TOOL_CHOICE_DISABLED",
    "TOOL_PARSERS",
    "ExtractedToolCallInformation",
    "Hermes2ProToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolParser",
    "PythonicToolParser",
    "RequiredToolParser",
    "ToolParser",
    "get_tool_parser",
    "merge_deltas",
]

# --tool-call-parser names (vLLM's) -> parser.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": Hermes2ProToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}

# vLLM's wording, which clients match on to fall back to prompting for tool use.
AUTO_TOOL_CHOICE_DISABLED = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


def get_tool_parser(
    request: ChatCompletionRequest, auto_tool_parser: str | None
) -> Callable[[], ToolParser] | None:
    """What makes a request's parsers (call it once per choice).

    Args:
        request: a validated request (``tool_choice`` is ``"auto"`` when tools came without it).
        auto_tool_parser: the server's ``--tool-call-parser`` when ``--enable-auto-tool-choice``
            is set, else None.

    Returns:
        None when the output is plain text (no tools, or ``tool_choice`` ``"none"``).

    Raises:
        ValueError: ``AUTO_TOOL_CHOICE_DISABLED`` for ``"auto"`` without ``auto_tool_parser``.
    """
    choice = request.tool_choice
    if choice is None or choice == "none":
        return None
    if choice == "auto":
        if auto_tool_parser is None:
            raise ValueError(AUTO_TOOL_CHOICE_DISABLED)
        return functools.partial(TOOL_PARSERS[auto_tool_parser], request.parallel_tool_calls)
    if choice == "required":
        return functools.partial(RequiredToolParser, request.tools, request.parallel_tool_calls)
    name = request.tool_choice_function_name
    function = next(tool.function for tool in request.tools if tool.function.name == name)
    return functools.partial(NamedToolParser, function)
