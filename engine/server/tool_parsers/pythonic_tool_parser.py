"""The ``pythonic`` tool parser (vLLM's ``PythonicToolParser``): Llama 3.2, Llama 4 and
ToolACE-style models answer a tool call with a Python list of calls, keyword arguments only:

    [get_weather(city="Paris", unit="celsius"), get_time(timezone="CET")]

The list is read with ``ast`` and never evaluated. Argument values are Python literals, taken
as vLLM takes them: strings, numbers (signs included), ``True``/``False``/``None`` (and JSON's
``true``/``false``/``null``), lists, tuples and sets (JSON arrays), dicts with literal keys, and
f-strings without placeholders; the arguments are sent as a JSON object. Function names may be
dotted (``a.b``). An output that is anything else (text, a list holding other values, a call
with positional arguments or a non-literal value, text after the list) is content, as it came.

An output that starts (after whitespace) with ``[name(`` is held back until it ends, then
parsed whole: streamed or not, the calls and content are the same. Any other output is content,
streamed as it comes once its start rules out a call list (``[`` alone waits).
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any

from kvpilot.engine.server.protocol import DeltaMessage, DeltaToolCall
from kvpilot.engine.server.tool_parsers.abstract_tool_parser import ToolParser

# The start of a call list, and of text that may still become one.
_CALLS_START = re.compile(r"\[\s*[^\W\d][\w.]*\s*\(")
_MAYBE_CALLS_START = re.compile(r"\[\s*(?:[^\W\d][\w.]*)?\s*\Z")
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicToolParser(ToolParser):
    """Extracts the calls of an output made of one Python list of calls (vLLM's
    ``PythonicToolParser``; see the module's docstring for what it accepts).

    Args:
        parallel_tool_calls: when False, only the first call is kept.
    """

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._buffer = ""
        self._mode: str | None = None  # None: undecided; "content" or "calls"

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        """Content as it comes in a plain answer; a call list's calls once the output ends."""
        self._buffer += delta_text
        if self._mode is None:
            start = self._buffer.lstrip()
            if _CALLS_START.match(start):
                self._mode = "calls"
            elif finished or (start and not _MAYBE_CALLS_START.match(start)):
                self._mode = "content"
            else:
                return None
        calls: list[DeltaToolCall] = []
        content = ""
        if self._mode == "content":
            content, self._buffer = self._buffer, ""
        elif finished:
            parsed = parse_pythonic_calls(self._buffer)
            if parsed is None:
                content = self._buffer
            else:
                for name, arguments in parsed:
                    if (call := self.start_tool_call(name, arguments)) is not None:
                        calls.append(call)
            self._buffer = ""
        text = self.stream_content(content, finished)
        if not text and not calls:
            return None
        return DeltaMessage(content=text or None, tool_calls=calls or None)


class _NotACall(ValueError):
    """Raised inside ``parse_pythonic_calls`` for a node that is not part of a valid call."""


def parse_pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """``[(name, arguments as JSON text), ...]`` of ``text`` when it is one Python list of calls
    (surrounding whitespace aside), else None. Parsed with ``ast``, never evaluated; any
    failure (a syntax error, nesting too deep for the parser, a value that is no literal or
    that JSON cannot hold, such as ``1e999``) means None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning for escapes such as "\d"
            tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        return [_call(node) for node in tree.body.elts]
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _call(node: ast.expr) -> tuple[str, str]:
    if not isinstance(node, ast.Call) or node.args:
        raise _NotACall("a list item is not a call with keyword arguments only")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise _NotACall("**arguments")
        arguments[keyword.arg] = _literal(keyword.value)
    return _dotted_name(node.func), json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise _NotACall("the called function is not a name")


def _literal(node: ast.expr) -> Any:
    """The JSON value of a literal argument (vLLM's ``get_parameter_value`` rules)."""
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, str | int | float)
    ):
        return node.value
    if isinstance(node, ast.Dict):
        if not all(isinstance(key, ast.Constant) for key in node.keys):
            raise _NotACall("dict keys must be literals")
        keys = [_literal(key) for key in node.keys]
        return dict(zip(keys, (_literal(value) for value in node.values), strict=True))
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(part.value) for part in node.values)
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise _NotACall(f"not a literal: {ast.dump(node)[:80]}")
