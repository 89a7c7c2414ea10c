"""Tool calls forced by ``tool_choice`` (a named function or ``"required"``): the output is
constrained with structured outputs, as vLLM does it, so it always parses.

- named: the output is the function's arguments, a JSON object valid against its
  ``parameters``; streamed as it is generated.
- ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, each
  valid against the schema of the tool it names (``anyOf`` over the tools); each call is sent
  once its object is complete.
"""

from __future__ import annotations

import json
from typing import Any

from kvpilot.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvpilot.engine.server.protocol import (
    ChatCompletionToolsParam,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionDefinition,
)
from kvpilot.engine.server.tool_parsers.abstract_tool_parser import ToolParser

# A function without parameters still takes a JSON object (OpenAI's empty arguments: "{}").
ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


class NamedToolParser(ToolParser):
    """``tool_choice`` names ``function``: the whole output is one call's arguments."""

    def __init__(self, function: FunctionDefinition) -> None:
        super().__init__()
        self.function = function

    def adjust_request(self, params: SamplingParams) -> None:
        """Constrain the output to the function's ``parameters`` schema."""
        params.structured_outputs = StructuredOutputsParams(
            json=self.function.parameters or ANY_OBJECT
        )

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """Unchanged (``stop``): OpenAI and vLLM answer a named ``tool_choice`` with ``stop``,
        ``tool_calls`` only when the model chose to call (``auto``, ``required``)."""
        return finish_reason

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        """The call's header with the first argument text, then argument pieces."""
        if not delta_text:
            return None
        if self.tools_called:
            call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta_text))
        else:
            call = self.start_tool_call(self.function.name, delta_text)
        return DeltaMessage(tool_calls=[call])


class RequiredToolParser(ToolParser):
    """``tool_choice: "required"``: at least one call, to any of ``tools``.

    Args:
        tools: the request's tools.
        parallel_tool_calls: when False, the array is constrained to one call.
    """

    def __init__(
        self, tools: list[ChatCompletionToolsParam], parallel_tool_calls: bool = True
    ) -> None:
        super().__init__(parallel_tool_calls)
        self.tools = tools
        self._text = ""
        self._pos = 0  # how far the array has been parsed
        self._opened = False

    def adjust_request(self, params: SamplingParams) -> None:
        """Constrain the output to ``json_schema()``.

        Raises:
            ValueError: ``tools: ...`` when two tools define the same ``$defs`` name differently.
        """
        params.structured_outputs = StructuredOutputsParams(json=self.json_schema())

    def json_schema(self) -> dict[str, Any]:
        """vLLM's schema: ``[{"name": <one tool's name>, "parameters": <its arguments>}, ...]``,
        with every tool's ``$defs`` moved to the root, where their ``#/$defs/...`` references
        point once the schema is nested.

        Raises:
            ValueError: ``tools: ...`` when two tools define the same ``$defs`` name differently.
        """
        defs: dict[str, Any] = {}
        alternatives = []
        for tool in self.tools:
            parameters = dict(tool.function.parameters or ANY_OBJECT)
            for name, schema in parameters.pop("$defs", {}).items():
                if defs.setdefault(name, schema) != schema:
                    raise ValueError(f"tools: $defs {name!r} is defined differently by two tools")
            alternatives.append(
                {
                    "properties": {
                        "name": {"type": "string", "enum": [tool.function.name]},
                        "parameters": parameters,
                    },
                    "required": ["name", "parameters"],
                }
            )
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": alternatives},
        }
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        """Each call once its object in the array is complete; at the end, any text that did
        not parse (an array cut short by ``max_tokens``) as content."""
        self._text += delta_text
        calls: list[DeltaToolCall] = []
        decoder = json.JSONDecoder()
        while True:
            pos = len(self._text) - len(self._text[self._pos :].lstrip())
            if not self._opened:
                if not self._text.startswith("[", pos):
                    break
                self._opened, self._pos = True, pos + 1
            elif self._text.startswith((",", "]"), pos):
                self._pos = pos + 1
            else:
                try:
                    item, end = decoder.raw_decode(self._text, pos)
                except ValueError:
                    break
                if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                    break
                self._pos = end
                arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
                if (call := self.start_tool_call(item["name"], arguments)) is not None:
                    calls.append(call)
        rest = self._text[self._pos :] if self.tools_called else self._text
        content = rest if finished and rest.strip() else None
        if content is None and not calls:
            return None
        return DeltaMessage(content=content, tool_calls=calls or None)
