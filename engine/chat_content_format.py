"""How a message's content reaches a chat template: vLLM's ``--chat-template-content-format``.

``string``: the text parts joined into one string (what most templates render); ``openai``: the
list of ``{"type": "text", "text": ...}`` parts, for templates that loop over a message's
content; ``auto``: the format the template that renders expects, found by reading its Jinja
syntax tree as vLLM's detection does. Imports jinja2 (through transformers) only to detect.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")
"""vLLM's ``--chat-template-content-format`` values."""
RESOLVED_CONTENT_FORMATS = ("string", "openai")
"""What ``"auto"`` resolves to (:func:`resolve_content_format`)."""


def resolve_content_format(
    given: str, template: str | Mapping[str, str] | None, has_tools: bool = False
) -> str:
    """The content format a conversation is parsed in (:func:`parse_chat_messages`), as vLLM
    resolves ``--chat-template-content-format``: ``"string"`` or ``"openai"`` as given; for
    ``"auto"``, the format the template expects (:func:`detect_content_format`).

    Args:
        given: one of ``CHAT_TEMPLATE_CONTENT_FORMATS``.
        template: the chat template that will render (a request's, the server's or the
            model's); a dict of named templates picks as transformers does (``tool_use`` when
            there are tools and it has one, else ``default``); None: ``"string"``.
        has_tools: the request passes tools to the template.

    Raises:
        ValueError: ``given`` is not one of ``CHAT_TEMPLATE_CONTENT_FORMATS``.
    """
    if given not in CHAT_TEMPLATE_CONTENT_FORMATS:
        raise ValueError(
            f"chat template content format must be one of "
            f"{', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}, got {given!r}"
        )
    if given != "auto":
        return given
    if isinstance(template, Mapping):
        name = "tool_use" if has_tools and "tool_use" in template else "default"
        template = template.get(name)
    if not isinstance(template, str):
        return "string"
    return detect_content_format(template)


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """``"openai"`` when a chat template iterates over a message's content (so it expects
    OpenAI's list of parts), else ``"string"``; a template that does not parse is taken as a
    string template. The rules are vLLM's ``auto`` detection: a ``for`` loop over
    ``message.content`` or ``message['content']`` (also through a filter, a test or a slice, and
    for any name bound to a message of ``messages``, or to ``messages`` itself, by ``set`` or
    ``for``), over a macro parameter that a call passes such a content, or over a variable
    named ``content`` outside a macro.
    """
    import jinja2.nodes

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        ast = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # noqa: BLE001 - any template error: vLLM falls back to "string" too
        return "string"
    return "openai" if _loops_over_content(ast, jinja2.nodes) else "string"


def _loops_over_content(ast: Any, nodes: Any) -> bool:
    """See :func:`detect_content_format`; ``nodes`` is ``jinja2.nodes``."""

    def target(node: Any) -> Any:
        """The variable an expression reads, through filters, tests and slices."""
        while True:
            if isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
                node = node.node
            elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
                node = node.node
            else:
                return node

    def is_name(node: Any, names: set[str]) -> bool:
        node = target(node)
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names

    def is_content_of(node: Any, names: set[str]) -> bool:
        node = target(node)
        if isinstance(node, nodes.Getattr):
            return node.attr == "content" and is_name(node.node, names)
        if isinstance(node, nodes.Getitem):
            key = node.arg
            is_content = isinstance(key, nodes.Const) and key.value == "content"
            return is_content and is_name(node.node, names)
        return False

    # Names bound to the conversation: ``messages`` and what a ``set`` copies it into.
    conversations = {"messages"}
    changed = True
    while changed:
        changed = False
        for assign in ast.find_all(nodes.Assign):
            if isinstance(assign.target, nodes.Name) and assign.target.name not in conversations:
                if is_name(assign.node, conversations):
                    conversations.add(assign.target.name)
                    changed = True
    # Names bound to one message: the targets of loops over the conversation.
    messages = {
        loop.target.name
        for loop in ast.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and is_name(loop.iter, conversations)
    }
    # Macro parameters that some call passes a message's content to.
    content_params: dict[str, set[str]] = {}
    for macro in ast.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        bound = set()
        for call in ast.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args[: len(params)]):
                if is_content_of(arg, messages):
                    bound.add(params[i])
            for keyword in call.kwargs:
                if keyword.key in params and is_content_of(keyword.value, messages):
                    bound.add(keyword.key)
        content_params[macro.name] = bound
    in_macro = set()
    for macro in ast.find_all(nodes.Macro):
        for loop in macro.find_all(nodes.For):
            in_macro.add(id(loop))
            if is_name(loop.iter, content_params[macro.name]):
                return True
    for loop in ast.find_all(nodes.For):
        if is_content_of(loop.iter, messages):
            return True
        if id(loop) not in in_macro and is_name(loop.iter, {"content"}):
            return True
    return False
