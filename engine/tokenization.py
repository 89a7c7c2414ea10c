"""User text and chat messages to prompt token ids, shared by the offline ``LLM`` and the server.

Chat prompts are rendered as vLLM renders them: the tokenizer's chat template
(transformers' ``apply_chat_template``) turns the conversation into text, which is tokenized
without adding special tokens again (the template already holds them, e.g. a BOS).

Every function here uses the tokenizer it is given from the calling thread: a Rust (fast)
tokenizer must not be used by two threads at once, so callers own one tokenizer per thread
(the server runs these on its tokenizer thread, see ``server/async_tokenizer.py``).

Errors are ``ValueError`` whose message starts with the parameter at fault (``prompt``,
``messages``, ``tools``, ``chat_template``, ``continue_final_message``), which the server turns
into a 400 naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpilot.engine.chat_content_format import RESOLVED_CONTENT_FORMATS

ChatMessage = Mapping[str, Any]
"""An OpenAI-style message: ``{"role": str, "content": str | [{"type": "text", "text": str}] |
None, "name": str (optional)}``; an assistant's may hold ``"tool_calls": [{"id", "type":
"function", "function": {"name", "arguments": JSON text}}]``, a ``"tool"`` message the
``"tool_call_id"`` it answers."""


def longest_token_bytes(tokenizer: Any) -> int:
    """The most bytes any one token of the vocabulary stands for (special tokens included):
    a text of ``n`` bytes is at least ``n / longest_token_bytes`` tokens."""
    vocab = tokenizer.get_vocab()
    return max(1, max(len(tokenizer.convert_tokens_to_string([t]).encode()) for t in vocab))


def max_prompt_chars(tokenizer: Any, max_prompt_tokens: int) -> int:
    """The longest text (characters) that could still be ``max_prompt_tokens`` tokens or
    fewer: twice what the longest token allows, a margin for normalizers that drop
    characters. Longer texts are refused before they are tokenized (which costs about 0.7 s of
    CPU per MB)."""
    return 2 * longest_token_bytes(tokenizer) * max_prompt_tokens


def check_prompt_chars(text: str, max_chars: int | None, param: str) -> None:
    """Refuse a text longer than ``max_chars`` characters (see :func:`max_prompt_chars`).

    Raises:
        ValueError: ``"{param}: the text is N characters, ..."``.
    """
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(
            f"{param}: the text is {len(text)} characters, more than any prompt that fits this "
            f"model's maximum context length could be ({max_chars} characters); it was refused "
            "before tokenizing. Please reduce the length of the "
            f"{param}."
        )


def encode_text(
    tokenizer: Any,
    text: str,
    param: str,
    add_special_tokens: bool = True,
    max_chars: int | None = None,
) -> list[int]:
    """Tokenize user text.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the text; JSON can carry lone surrogates (``"\\ud800"``) that are not Unicode.
        param: the request parameter the text came from (named in errors).
        add_special_tokens: add the tokenizer's BOS/EOS as configured (False for rendered chat
            templates).
        max_chars: refuse longer texts without tokenizing them (:func:`check_prompt_chars`).

    Returns:
        ``[num_tokens]`` token ids.

    Raises:
        ValueError: ``"{param}: the text is not valid Unicode (...)"`` for a lone surrogate,
            which the tokenizer would refuse with a ``TypeError``; a text over ``max_chars``.
    """
    check_prompt_chars(text, max_chars, param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{param}: the text is not valid Unicode ({exc.reason})") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


BILLING_HEADER = "x-anthropic-billing-header"
"""How Claude Code's per-request attribution line starts: left out of system prompts (its hash
changes with every request and would defeat prefix caching), as vLLM leaves it out."""


def without_billing_header(content: Any) -> Any:
    """A system message's content without a leading ``BILLING_HEADER`` line (the rest of its
    text part stays; a part that was only that line goes); other content as it is."""

    def strip(text: str) -> str | None:
        if not text.startswith(BILLING_HEADER):
            return text
        return text.partition("\n")[2] or None

    if isinstance(content, str):
        return strip(content) or ""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            text = strip(part["text"])
            if text is None:
                continue
            part = {**part, "text": text}
        parts.append(part)
    return parts


def parse_chat_messages(
    messages: Sequence[ChatMessage], content_format: str = "string"
) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and flatten them into what chat templates read.

    Args:
        messages: the conversation, oldest first; content is a string, None, or a list of
            ``{"type": "text", "text": ...}`` parts.
        content_format: how the content reaches the template, as vLLM's
            ``--chat-template-content-format`` resolves it (``chat_content_format.resolve_content_format``):
            ``"string"``, the text parts joined one a line (``TEXT_PART_SEPARATOR``), None as
            ``""``; ``"openai"``, a list of ``{"type": "text", "text": ...}`` parts (a string
            as one part, None as ``[]``).

    Returns:
        ``[{"role", "content"(, "name", "tool_calls", "tool_call_id", "reasoning",
        "reasoning_content")}]``; tool call arguments are parsed from JSON text into dicts, as
        transformers' tool-use templates expect them (vLLM does the same); an assistant turn's
        ``reasoning`` (or ``reasoning_content``) goes to the template under both names; a
        system message's leading ``BILLING_HEADER`` line is left out (``without_billing_header``).

    Raises:
        ValueError: ``messages: ...`` for an empty conversation, a message that is not a mapping,
            a missing or non-string role, content that is not text, or a tool call without a
            function name or whose arguments are not a JSON object; a ``content_format`` other
            than ``"string"`` or ``"openai"``.
    """
    if content_format not in RESOLVED_CONTENT_FORMATS:
        raise ValueError(
            f"content_format must be one of {', '.join(RESOLVED_CONTENT_FORMATS)}, "
            f"got {content_format!r}"
        )
    if isinstance(messages, str | bytes | Mapping) or not messages:
        raise ValueError("messages: must be a non-empty list of messages")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages: message {i} must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages: message {i} needs a string 'role'")
        content = message.get("content")
        if role == "system":
            content = without_billing_header(content)
        if content_format == "openai":
            entry = {"role": role, "content": _content_parts(content, i)}
        else:
            entry = {"role": role, "content": _content_text(content, i)}
        if message.get("name") is not None:
            entry["name"] = str(message["name"])
        if message.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(message["tool_calls"], i)
        if message.get("tool_call_id") is not None:
            entry["tool_call_id"] = str(message["tool_call_id"])
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if role == "assistant" and isinstance(reasoning, str):
            # Both names, as vLLM gives templates an earlier turn's reasoning.
            entry["reasoning"] = entry["reasoning_content"] = reasoning
        conversation.append(entry)
    return conversation


def parse_chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Check OpenAI function tools before they reach a chat template.

    Args:
        tools: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``
            (``type`` may be left out; ``parameters`` is the arguments' JSON Schema).

    Returns:
        The tools, in order, each as a ``dict`` (its contents unchanged).

    Raises:
        ValueError: ``tools: ...`` for a value that is not a list of dicts, a tool whose type
            is not ``"function"``, a function without a string name or whose ``parameters``
            are not a dict, or two functions with one name.
    """
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise ValueError(f"tools: must be a list of function tools, got {type(tools).__name__}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools: tool {i} must be a dict, got {type(tool).__name__}")
        kind = tool.get("type", "function")
        if kind != "function":
            raise ValueError(
                f"tools: tool {i} has type {kind!r}; only 'function' tools are supported"
            )
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools: tool {i} needs a function with a string name")
        name = function["name"]
        if not isinstance(function.get("parameters") or {}, Mapping):
            raise ValueError(f"tools: the parameters of function {name!r} must be a JSON object")
        if name in names:
            raise ValueError(f"tools: function names must be unique; {name!r} repeats")
        names.add(name)
    return [dict(tool) for tool in tools]


def _tool_calls(tool_calls: Any, index: int) -> list[dict[str, Any]]:
    where = f"messages: message {index} tool_calls"
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where} must be a list")
    parsed = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}[{j}] needs a function with a name")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, Mapping):
            raise ValueError(f"{where}[{j}] arguments must be a JSON object")
        entry = {
            "type": "function",
            "function": {"name": function["name"], "arguments": dict(arguments)},
        }
        if call.get("id") is not None:
            entry["id"] = str(call["id"])
        parsed.append(entry)
    return parsed


TEXT_PART_SEPARATOR = "\n"
"""What joins a message's text content parts into the string its template renders."""


def _content_parts(content: Any, index: int) -> list[dict[str, str]]:
    """A message's content as OpenAI's list of text parts (vLLM's ``openai`` format)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    _check_text_parts(content, index)
    return [{"type": "text", "text": part["text"]} for part in content]


def _content_text(content: Any, index: int) -> str:
    """A message's content as one string (vLLM's ``string`` format)."""
    if content is None or isinstance(content, str):
        return content or ""
    _check_text_parts(content, index)
    # One line a part, as vLLM (and TensorRT-LLM, Dynamo) join them for string templates.
    return TEXT_PART_SEPARATOR.join(part["text"] for part in content)


def _check_text_parts(content: Any, index: int) -> None:
    if isinstance(content, list) and all(
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
        for part in content
    ):
        return
    raise ValueError(
        f"messages: message {index} content must be a string or a list of text parts "
        "({'type': 'text', 'text': ...})"
    )


def content_text(content: str | list[Mapping[str, Any]] | None) -> str:
    """The text of a parsed message's content in either format (parts joined one a line)."""
    if content is None or isinstance(content, str):
        return content or ""
    return TEXT_PART_SEPARATOR.join(part["text"] for part in content)


def load_chat_template(value: str) -> str:
    """Resolve a chat template given as a file path or as the Jinja text itself, as vLLM's
    ``--chat-template`` does, and check that it compiles.

    Args:
        value: a path to a Jinja file, or an inline template: a value that is no readable file
            and holds one of ``{``, ``}`` or a newline. Escapes in an inline template are
            interpreted (``\\n`` typed on a command line becomes a newline), as vLLM does.

    Returns:
        The template text.

    Raises:
        ValueError: a path-like value that cannot be read, an inline template with a broken
            escape, or a template that does not compile (``compile_chat_template``).
    """
    try:
        template = Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or a NUL in the value
        if not any(char in value for char in "{}\n"):
            raise ValueError(
                f"{value!r} looks like a file path, but it cannot be read: {exc}"
            ) from None
        try:
            # Characters beyond Latin-1 survive as \uXXXX escapes; the others are one byte.
            template = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError as exc:
            raise ValueError(f"the inline template has an invalid escape: {exc.reason}") from None
    compile_chat_template(template)
    return template


def compile_chat_template(template: str) -> None:
    """Check that a chat template compiles in transformers' Jinja environment (the one
    ``apply_chat_template`` renders with; transformers caches the compiled template).

    Raises:
        ValueError: ``"the template does not compile: {reason} (line N)"``.
    """
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(
            f"the template does not compile: {exc.message} (line {exc.lineno})"
        ) from None


# What the template call gets that is not a template variable (the conversation, under both
# its names, and how the text is rendered and returned): chat_template_kwargs cannot set these.
NOT_TEMPLATE_VARIABLES = frozenset(
    {
        "conversation",
        "messages",
        "tokenizer",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "max_chars",
    }
)


def merge_chat_template_kwargs(
    *,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`apply_chat_template`'s keyword arguments with ``chat_template_kwargs`` merged over
    the others, as vLLM merges them: a template variable given there (``add_generation_prompt``,
    ``continue_final_message``, ``tools``) wins over the argument of the same name; the rest
    (``documents``, ``enable_thinking``, ...) stay in ``chat_template_kwargs``.

    Raises:
        ValueError: ``chat_template_kwargs: ...`` naming a key of ``NOT_TEMPLATE_VARIABLES``
            (vLLM refuses ``tokenize`` there the same way).
    """
    variables = dict(chat_template_kwargs or {})
    if refused := sorted(NOT_TEMPLATE_VARIABLES & variables.keys()):
        names = ", ".join(repr(name) for name in refused)
        raise ValueError(
            f"chat_template_kwargs: {names} cannot be set here: "
            f"{'it is' if len(refused) == 1 else 'they are'} set when the messages are rendered, "
            "and only template variables (such as add_generation_prompt or enable_thinking) "
            "may be given"
        )
    return {
        "tools": variables.pop("tools", tools),
        "chat_template": variables.pop("chat_template", chat_template),
        "add_generation_prompt": variables.pop("add_generation_prompt", add_generation_prompt),
        "continue_final_message": variables.pop("continue_final_message", continue_final_message),
        "chat_template_kwargs": variables,
    }


def with_reasoning_effort(
    effort: str | None, chat_template_kwargs: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """A request's template variables with OpenAI's ``reasoning_effort``, as vLLM passes it:
    the variable of that name, and ``enable_thinking`` (false for ``"none"``) unless the
    request's ``chat_template_kwargs`` set them; unchanged without an effort."""
    if effort is None:
        return None if chat_template_kwargs is None else dict(chat_template_kwargs)
    derived = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
    return derived | dict(chat_template_kwargs or {})


def developer_as_system(conversation: list[dict[str, Any]], template: Any) -> list[dict[str, Any]]:
    """OpenAI's ``developer`` role for a chat template that does not know it, as vLLM maps it.

    A template that names ``"developer"`` (quoted) renders the messages as they are. For any
    other, ``developer`` messages become ``system`` ones, and when that leaves a system message
    anywhere but first, or more than one, they are merged (contents joined by a blank line)
    into one system message at the start: templates that read the system prompt from the first
    message only (most do) would otherwise add their default one and render the rest as an
    unknown role.

    Args:
        conversation: messages as ``parse_chat_messages`` returns them (not modified).
        template: the chat template to render with (a string, or a dict of named ones).

    Returns:
        The conversation to render (the same list when no change is needed).
    """
    if not any(m["role"] == "developer" for m in conversation):
        return conversation
    texts = template.values() if isinstance(template, Mapping) else [template]
    if any('"developer"' in t or "'developer'" in t for t in texts if isinstance(t, str)):
        return conversation
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in conversation
    ]
    system = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if system == [0]:
        return converted
    # One string, whichever the content format (as vLLM merges them).
    texts = (content_text(converted[i]["content"]) for i in system)
    merged = {"role": "system", "content": "\n\n".join(text for text in texts if text)}
    return [merged] + [m for m in converted if m["role"] != "system"]


def apply_chat_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_chars: int | None = None,
) -> list[int]:
    """Render a conversation with the chat template and tokenize it.

    Args:
        tokenizer: a Hugging Face tokenizer.
        conversation: messages as ``parse_chat_messages`` returns them.
        tools: OpenAI function tools as ``parse_chat_tools`` returns them, for templates that
            describe them to the model; templates without tool support ignore them.
        chat_template: a Jinja template to use instead of the tokenizer's own (errors in it, or
            in its rendering, name ``chat_template``).
        add_generation_prompt: end with the header of an assistant reply (what a model needs
            to answer).
        continue_final_message: leave the last message open, so that the model continues it
            (excludes ``add_generation_prompt``).
        chat_template_kwargs: extra variables for the template (e.g. ``enable_thinking``);
            merged over the arguments above (:func:`merge_chat_template_kwargs`).
        max_chars: refuse a rendered prompt longer than this without tokenizing it
            (:func:`check_prompt_chars`, naming ``messages``).

    Returns:
        ``[num_tokens]`` prompt token ids, equal to transformers'
        ``apply_chat_template(conversation, tokenize=True, ...)``.

    Raises:
        ValueError: ``messages: ...`` when the model has no chat template, the template refuses
            the conversation (a Jinja error, e.g. roles that do not alternate), the text is not
            valid Unicode or renders to nothing; ``chat_template: ...`` instead when the template
            was given here (and also when it does not compile); ``continue_final_message: ...``
            together with ``add_generation_prompt``; ``chat_template_kwargs: ...`` for a key
            that is not a template variable.
    """
    # transformers' own keyword names: tools, chat_template, add_generation_prompt,
    # continue_final_message; the other template variables go in beside them.
    options = merge_chat_template_kwargs(
        tools=tools,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs=chat_template_kwargs,
    )
    variables = options.pop("chat_template_kwargs")
    chat_template = options["chat_template"]
    if options["continue_final_message"] and options["add_generation_prompt"]:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: the model has no chat template")
    param = "messages" if chat_template is None else "chat_template"
    if chat_template is not None:
        try:
            compile_chat_template(chat_template)
        except ValueError as exc:
            raise ValueError(f"chat_template: {exc}") from None
    conversation = developer_as_system(
        conversation, chat_template or getattr(tokenizer, "chat_template", None)
    )
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **options, **variables)
    except Exception as exc:  # jinja2 errors from the template itself: the input's fault
        raise ValueError(f"{param}: the chat template refused them: {exc}") from None
    token_ids = encode_text(
        tokenizer, text, "messages", add_special_tokens=False, max_chars=max_chars
    )
    if not token_ids:
        raise ValueError(f"{param}: the rendered prompt is empty")
    return token_ids
