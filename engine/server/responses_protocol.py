"""OpenAI's Responses API bodies (``POST /v1/responses``), as vLLM serves them for text models.

A request is read into a chat completion (``ResponsesRequest.to_chat_request``): ``input`` and
``instructions`` become messages (``responses_items.input_messages``), ``max_output_tokens``
the output limit, ``text.format`` the structured-output constraint, the flat function
``tools`` chat's nested ones; vLLM's extra sampling fields (``top_k``, ``seed``,
``repetition_penalty``, ``priority``, ...) are taken as on the other endpoints. Field names are
OpenAI's (https://platform.openai.com/docs/api-reference/responses).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from kvpilot.engine.server.protocol import (
    MAX_LOGPROBS,
    ChatCompletionRequest,
    OpenAIModel,
    ReasoningEffort,
    _SamplingFields,
)
from kvpilot.engine.server.responses_items import continues_final_message

OUTPUT_LOGPROBS = "message.output_text.logprobs"
"""The ``include`` entry that asks for the output's logprobs (with ``top_logprobs``
candidates each)."""
Includable = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
]
"""OpenAI's ``include`` values; only ``OUTPUT_LOGPROBS`` adds anything here (the others are
about tools and content this server does not have)."""

# Fields of the Responses API that name what this server does not have.
_REFUSED = {
    "prompt": "prompt templates (prompt) are not supported; send input and instructions",
    "conversation": "conversations are not supported; continue a response with "
    "previous_response_id",
}


class FunctionTool(OpenAIModel):
    """A ``tools`` entry: the Responses API's flat function tool (chat nests the same fields
    under ``function``)."""

    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(OpenAIModel):
    """``text.format``: free ``text``, any JSON object, or JSON valid against ``schema``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("text: format type 'json_schema' needs a 'schema' (a JSON Schema)")
        return self


class ReasoningConfig(OpenAIModel):
    """``reasoning``: ``effort`` reaches the chat template as chat completions'
    ``reasoning_effort`` does (and with it ``enable_thinking``); ``summary`` is accepted and
    unused (the reasoning item carries the reasoning itself)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextConfig(OpenAIModel):
    """``text``: the output's format (``format``)."""

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(_SamplingFields):
    """``POST /v1/responses``.

    Attributes:
        input: a user message as a string, or a list of items: messages (``role`` and
            ``content``, a string or ``input_text``/``output_text`` parts), ``function_call``
            and ``function_call_output`` items, ``reasoning`` items (the next assistant turn's
            ``reasoning``, for templates that render it).
        instructions: a system message put first.
        max_output_tokens: the most tokens to generate; None: the rest of the context.
        previous_response_id: continue a stored response (the server must keep responses:
            ``--enable-responses-store``); its conversation comes before ``input``, without
            its instructions.
        store: keep the response for ``previous_response_id`` and ``GET /v1/responses/{id}``;
            without a store on the server it is ignored, as vLLM ignores it.
        include: ``"message.output_text.logprobs"`` returns the output's logprobs.
        top_logprobs: candidates per output token with those logprobs (0-20).
        text: ``{"format": ...}``, see ``TextFormat``.
        tools, tool_choice, parallel_tool_calls: function calling, as in chat completions;
            ``tool_choice`` names a function as ``{"type": "function", "name": ...}``.
        reasoning: ``{"effort", "summary"}`` (``ReasoningConfig``); the server's
            ``--reasoning-parser`` splits the reasoning off, vLLM's ``include_reasoning``
            leaves it out.
        truncation: ``"disabled"`` (a prompt over the context is refused) or ``"auto"`` (its
            oldest tokens are dropped).
        background: refused when true: responses are answered while the request waits.
        metadata, service_tier, prompt_cache_key, max_tool_calls: accepted and echoed.
    """

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    previous_response_id: str | None = None
    store: bool = True
    include: list[Includable] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] = 0
    text: TextConfig | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    include_reasoning: bool = True
    truncation: Literal["auto", "disabled"] = "disabled"
    background: bool = False
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    prompt_cache_key: str | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        for name, reason in _REFUSED.items():
            if isinstance(data, dict) and data.get(name) is not None:
                raise ValueError(f"{name}: {reason}")
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        # One message instead of pydantic's for each member of the union.
        if isinstance(value, str) or (isinstance(value, list) and value):
            return value
        raise ValueError("input: must be a string or a list of at least 1 item")

    @field_validator("tools")
    @classmethod
    def _check_tool_types(cls, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, tool in enumerate(tools):
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(
                    f"tools: tool {i} has type {kind!r}: only 'function' tools are supported "
                    "(built-in tools such as web_search or file_search are not)"
                )
            try:
                FunctionTool.model_validate(tool)
            except ValidationError as exc:
                first = exc.errors(include_url=False)[0]
                where = ".".join(map(str, first["loc"]))
                raise ValueError(f"tools: tool {i}: {where}: {first['msg']}") from None
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, choice: Any) -> Any:
        if isinstance(choice, dict) and (
            choice.get("type") != "function" or not isinstance(choice.get("name"), str)
        ):
            raise ValueError(
                "tool_choice: must be 'none', 'auto', 'required' or "
                f'{{"type": "function", "name": ...}}; got {choice!r}'
            )
        return choice

    @model_validator(mode="after")
    def _check_responses(self) -> ResponsesRequest:
        if self.background:
            raise ValueError(
                "background: background responses are not supported; send the request "
                "without background (stream it to read the output as it comes)"
            )
        if self.n != 1:
            raise ValueError("n: a response has one output; n is not a Responses API field")
        return self

    @property
    def wants_logprobs(self) -> bool:
        """Whether the output's logprobs were asked for (``include``)."""
        return OUTPUT_LOGPROBS in (self.include or ())

    def to_chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion that generates this response.

        Args:
            messages: the conversation (``responses_items.input_messages``).

        Raises:
            pydantic.ValidationError: what chat completions refuse (named by chat's fields:
                ``serving_responses.responses_error`` renames them).
        """
        body = self.forwarded_fields() | {
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "logprobs": self.wants_logprobs,
            "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
            "parallel_tool_calls": self.parallel_tool_calls,
            "include_reasoning": self.include_reasoning,
            "chat_template_kwargs": self.chat_template_kwargs,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
        }
        if continues_final_message(self.input):
            body |= {"add_generation_prompt": False, "continue_final_message": True}
        if self.truncation == "auto":
            body["truncate_prompt_tokens"] = -1
        if self.tools:
            body["tools"] = [chat_tool(tool) for tool in self.tools]
        if self.tools or self.tool_choice not in ("auto", "none"):
            # Without tools, "required" or a named function is chat's 400 (as vLLM's).
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        if self.text is not None and self.text.format.type != "text":
            body["response_format"] = chat_response_format(self.text.format)
        return ChatCompletionRequest.model_validate(body)


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool as chat completions' ``tools`` entry."""
    function = FunctionTool.model_validate(tool).model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """A Responses ``tool_choice`` as chat completions': a named function nests its name."""
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_response_format(text_format: TextFormat) -> dict[str, Any]:
    """A ``text.format`` as chat completions' ``response_format``."""
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = text_format.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
    return {"type": "json_schema", "json_schema": schema}


class ResponseUsage(OpenAIModel):
    """A response's ``usage``: prompt (``input``) and generated (``output``) tokens.

    ``input_tokens_details``: ``cached_tokens``, prompt tokens read from the prefix cache, and
    ``cache_write_tokens``, those of full blocks the request added to it;
    ``output_tokens_details.reasoning_tokens``: generated tokens of the reasoning.
    """

    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponsesResponse(OpenAIModel):
    """A response (``object: "response"``), whole or as streaming events carry it.

    ``status``: ``"in_progress"`` while streaming, ``"completed"``, or ``"incomplete"`` with
    ``incomplete_details.reason`` ``"max_output_tokens"`` when the output was cut at the limit.
    ``output``: items, each a dict (``responses_items``): a ``reasoning`` item, a ``message``
    with ``output_text`` content, ``function_call`` items. The request's settings are echoed.
    """

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int = 0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    service_tier: str = "auto"
    prompt_cache_key: str | None = None
    max_tool_calls: int | None = None

    @classmethod
    def of(
        cls, request: ResponsesRequest, response_id: str, model: str, **fields: Any
    ) -> ResponsesResponse:
        """A response to ``request`` echoing its settings; ``fields`` sets the rest."""
        echoed = request.model_dump(
            include={
                "instructions",
                "max_output_tokens",
                "previous_response_id",
                "temperature",
                "top_p",
                "top_logprobs",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "reasoning",
                "truncation",
                "metadata",
                "user",
                "service_tier",
                "prompt_cache_key",
                "max_tool_calls",
            },
            by_alias=True,
        )
        if request.text is not None:
            echoed["text"] = request.text.model_dump(by_alias=True, exclude_none=True)
        if request.reasoning is not None:
            echoed["reasoning"] = request.reasoning.model_dump(exclude_none=True)
        return cls(id=response_id, model=model, **echoed | fields)
