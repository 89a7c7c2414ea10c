"""OpenAI API request and response bodies (pydantic), with vLLM's extra sampling parameters.

Field names are OpenAI's (https://platform.openai.com/docs/api-reference); where OpenAI has no
name for an engine feature, vLLM's extension name is used (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``include_stop_str_in_output``, ``ignore_eos``,
``min_tokens``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
``structured_outputs``, ``chat_template``; older vLLM's ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar`` as deprecated aliases of ``structured_outputs``).
Unknown fields are accepted and ignored, as OpenAI and vLLM do; OpenAI's deprecated
``functions``/``function_call`` and vLLM's ``use_beam_search`` are refused (they would change
the answer). Float parameters must be finite: JSON's ``NaN``/``Infinity``, which Python's parser
accepts, are refused.
"""

from __future__ import annotations

import functools
import time
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from kvpilot import __version__
from kvpilot.engine.input_processor import check_cache_salt, check_sampling_params
from kvpilot.engine.outputs import Logprob
from kvpilot.engine.sampling_params import (
    SamplingParams,
    StructuredOutputsParams,
    check_thinking_token_budget,
    is_unicode,
)
from kvpilot.engine.structured_output import check_json_schema
from kvpilot.engine.tokenization import TEXT_PART_SEPARATOR, parse_chat_tools

# OpenAI's ``system_fingerprint`` of completions, chat completions and their chunks (the
# backend that answered; vLLM's reads ``vllm-<version>-<config hash>``). Clients log it.
SYSTEM_FINGERPRINT = f"kvpilot-{__version__}"
# vLLM's default --max-logprobs: the most top logprobs one request may ask for.
MAX_LOGPROBS = 20
# Seeds are 64-bit signed integers (torch.Generator's range, as vLLM bounds them).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Older vLLM's request fields for structured outputs, accepted as deprecated aliases.
GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
)


class OpenAIModel(BaseModel):
    """A request body's base: unknown fields ignored, and an explicit ``null`` for a field
    whose default is not ``null`` (``n``, ``stream``, ``echo``, chat's ``logprobs``,
    ``parallel_tool_calls``, ...) read as that default, as OpenAI's API and vLLM read it (the
    ``openai`` client sends ``null`` for a parameter given as ``None``). Fields that take
    ``null`` keep it (``max_tokens``, chat's and completions' as vLLM reads them: the rest of
    the context)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _non_nullable_defaults(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


def _holds_lone_surrogate(value: Any) -> bool:
    """Whether a JSON value holds, in any string or key, a code point UTF-8 cannot encode."""
    if isinstance(value, str):
        return not value.isascii() and not is_unicode(value)
    if isinstance(value, dict):
        return any(_holds_lone_surrogate(k) or _holds_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_holds_lone_surrogate(v) for v in value)
    return False


@functools.cache
def _non_nullable_defaults(model: type[BaseModel]) -> frozenset[str]:
    """Names and aliases of ``model``'s optional fields whose type does not take ``None``."""
    names = set()
    for name, info in model.model_fields.items():
        nullable = info.annotation is Any or type(None) in typing.get_args(info.annotation)
        if not info.is_required() and not nullable and info.annotation is not type(None):
            names.add(name)
            if info.alias:
                names.add(info.alias)
    return frozenset(names)


class StreamOptions(OpenAIModel):
    """``stream_options``: ``include_usage`` sends a last chunk with the request's usage (and
    no choices); vLLM's ``continuous_usage_stats`` with it puts the usage so far on every
    chunk too."""

    include_usage: bool = False
    continuous_usage_stats: bool = False

    def every_chunk(self) -> bool:
        """Whether every chunk carries the usage so far."""
        return self.include_usage and self.continuous_usage_stats


class JsonSchemaResponseFormat(OpenAIModel):
    """``response_format.json_schema``: OpenAI's named JSON Schema (``schema`` in JSON)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's ``response_format``: free ``text``, any JSON object, or JSON valid against a
    schema (structured outputs)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.json_schema is None
        ):
            raise ValueError(
                "response_format: type 'json_schema' needs json_schema.schema (a JSON Schema)"
            )
        return self


class _SamplingFields(OpenAIModel):
    """Sampling parameters shared by completions and chat completions."""

    # Every float field of a request (temperature, penalties, logit_bias values, ...) must be
    # finite: "Input should be a finite number" instead of a range error about NaN.
    model_config = ConfigDict(allow_inf_nan=False)

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    # vLLM's: lower is served first with --scheduling-policy priority; must be 0 under fcfs.
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    response_format: ResponseFormat | None = None
    # vLLM's extension: json, regex, choice, grammar or json_object.
    structured_outputs: StructuredOutputsParams | None = None
    # Older vLLM's names for structured_outputs' json, regex, choice and grammar (deprecated
    # aliases, moved into structured_outputs by _check_structured_outputs);
    # guided_whitespace_pattern is refused (xgrammar takes no whitespace pattern).
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's extension: each prompt token's logprob with this many top candidates, returned
    # as prompt_logprobs (on each completion choice; at the top of a chat completion).
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None
    # vLLM's extensions: keep only the prompt's last k tokens (-1: as many as leave room for
    # one output token); sample only among allowed_token_ids; never write bad_words; logprobs'
    # tokens as "token_id:<id>"; the prompt's and the output's token ids in the response
    # (return_token_ids, what RL trainers read); the response's id (the X-Request-Id header
    # wins over it; the engine's own id stays unique).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    request_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        # JSON may carry lone surrogates ("\ud800"), which no tokenizer, regex or response
        # can use: a 400 naming the field, whichever it is, instead of a 500 later.
        if isinstance(data, dict):
            for key, value in data.items():
                if _holds_lone_surrogate(value):
                    raise ValueError(
                        f"{key}: the text is not valid Unicode (it holds a lone surrogate)"
                    )
        return data

    @model_validator(mode="before")
    @classmethod
    def _refuse_beam_search(cls, data: Any) -> Any:
        # vLLM's use_beam_search: ignoring it would answer with samples, not beams.
        if isinstance(data, dict) and data.get("use_beam_search"):
            raise ValueError(
                "use_beam_search: beam search is not supported by kvpilot; leave it out to "
                "sample (n completions, best_of == n)"
            )
        return data

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, cache_salt: str | None) -> str | None:
        # vLLM refuses an empty salt (check_cache_salt_support) rather than ignoring it.
        check_cache_salt(cache_salt)
        return cache_salt

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available when stream is true")
        # Sequence i of n samples with seed + i.
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise ValueError(f"seed: seed + n - 1 must be at most {SEED_MAX}")
        return self

    @model_validator(mode="after")
    def _check_structured_outputs(self) -> _SamplingFields:
        guided = self.guided_fields
        constrains_format = self.response_format is not None and self.response_format.type != "text"
        if guided:
            if self.guided_whitespace_pattern is not None:
                raise ValueError(
                    "guided_whitespace_pattern: not supported; use structured_outputs with "
                    "disable_any_whitespace for JSON without optional whitespace"
                )
            for other, present in (
                ("structured_outputs", self.structured_outputs is not None),
                ("response_format", constrains_format),
            ):
                if present:
                    raise ValueError(f"{guided[0]}: cannot be combined with {other}")
            if len(guided) > 1:
                raise ValueError(f"{guided[0]}: set only one of {', '.join(guided)}")
            try:
                self.structured_outputs = StructuredOutputsParams(
                    **{name.removeprefix("guided_"): getattr(self, name) for name in guided}
                )
            except ValueError as exc:
                reason = str(exc).removeprefix("structured_outputs: ")
                raise ValueError(f"{guided[0]}: {reason}") from None
        elif self.structured_outputs is not None and constrains_format:
            raise ValueError("structured_outputs: cannot be combined with response_format")
        return self

    def forwarded_fields(self, *exclude: str) -> dict[str, Any]:
        """The sampling fields this request set, as a chat completion's body takes them: for a
        request of another API made into one (Responses, Anthropic Messages). Without ``n``,
        ``stream_options`` and ``response_format`` (those APIs have their own), the deprecated
        ``guided_*`` fields (``structured_outputs`` holds their constraint by now), and
        ``exclude``."""
        left_out = {"n", "stream_options", "response_format", *GUIDED_FIELDS, *exclude}
        return self.model_dump(
            include=set(_SamplingFields.model_fields) - left_out, exclude_unset=True, by_alias=True
        )

    @property
    def guided_fields(self) -> list[str]:
        """The deprecated ``guided_*`` fields the request sets (``guided_json``, ...)."""
        return [name for name in GUIDED_FIELDS if getattr(self, name) is not None]

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        vocab_size: int,
        defaults: SamplingParams | None = None,
    ) -> SamplingParams:
        """Build the engine's ``SamplingParams``; unset fields take ``defaults``' values (the
        model's generation config over vLLM's defaults; ``SamplingParams()`` when None).

        Raises:
            ValueError: a value out of range (message starts with the parameter name), or a
                ``logit_bias`` key that is not a token id of the model.
        """
        logit_bias = None
        if self.logit_bias:
            logit_bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token_id = int(key)
                except ValueError:
                    raise ValueError(f"logit_bias: key {key!r} is not a token id") from None
                logit_bias[token_id] = value
        defaults = defaults or SamplingParams()
        params = SamplingParams(
            n=self.n,
            temperature=_default(self.temperature, defaults.temperature),
            top_p=_default(self.top_p, defaults.top_p),
            top_k=_default(self.top_k, defaults.top_k),
            min_p=_default(self.min_p, defaults.min_p),
            seed=self.seed,
            presence_penalty=_default(self.presence_penalty, defaults.presence_penalty),
            frequency_penalty=_default(self.frequency_penalty, defaults.frequency_penalty),
            repetition_penalty=_default(self.repetition_penalty, defaults.repetition_penalty),
            logit_bias=logit_bias,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.num_prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self.structured_outputs_params(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            thinking_token_budget=self.requested_thinking_budget(),
        )
        check_sampling_params(params, vocab_size)
        return params

    def requested_thinking_budget(self) -> int | None:
        """``SamplingParams.thinking_token_budget``: None here; the APIs that take vLLM's
        ``thinking_token_budget`` field (``_ThinkingBudgetFields``) return it."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs to compute per prompt token (``SamplingParams.prompt_logprobs``), or
        None for no prompt logprobs."""
        return self.prompt_logprobs

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint: ``structured_outputs`` as given, or ``response_format``'s
        (``json_object``: any JSON object; ``json_schema``: its schema); None for free text."""
        if self.structured_outputs is not None:
            return self.structured_outputs
        response_format = self.response_format
        if response_format is None or response_format.type == "text":
            return None
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=response_format.json_schema.json_schema)

    @property
    def structured_outputs_param(self) -> str:
        """The parameter that carries the constraint (named in errors): ``response_format``,
        ``structured_outputs`` or the ``guided_*`` field it came from."""
        if self.guided_fields:
            return self.guided_fields[0]
        return "response_format" if self.structured_outputs is None else "structured_outputs"


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


ThinkingTokenBudget = Annotated[int | None, BeforeValidator(check_thinking_token_budget)]
"""An integer >= 0 (tokens), or -1 / null for no limit (read as None); anything else, floats
and booleans included, is refused (vLLM's check)."""


class _ThinkingBudgetFields(_SamplingFields):
    """The sampling fields with vLLM's ``thinking_token_budget``: the most tokens the model may
    think (tokens of its think block, the prompt's included), after which the engine forces
    the block's end; -1 or null for no limit. vLLM takes it on chat completions and completions
    only (Anthropic's ``thinking.budget_tokens`` is read into it; Responses has none). A value
    other than an integer >= 0 or -1 is a 400 naming it; a budget on a server without a
    reasoning config (``--reasoning-parser`` / ``--reasoning-config``) is a 400 too."""

    thinking_token_budget: ThinkingTokenBudget = None

    def requested_thinking_budget(self) -> int | None:
        return self.thinking_token_budget


class CompletionRequest(_ThinkingBudgetFields):
    """``POST /v1/completions``. ``prompt``: text, token ids, or a batch of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with echo: the prompt alone comes back (OpenAI's way to score a prompt). An
    # explicit null, as vLLM reads it: the rest of the context.
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_prompt_shape(cls, data: Any) -> Any:
        # One clear message instead of pydantic's four union-member errors.
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if prompt is None or isinstance(prompt, str):
            return data
        if isinstance(prompt, list):
            kinds = {type(p) for p in prompt}
            if (
                kinds <= {str}
                or kinds <= {int}
                or (kinds <= {list} and all(type(t) is int for p in prompt for t in p))
            ):
                return data
        raise ValueError(
            "prompt: must be a string, a list of strings, a list of token ids or a list of "
            "token id lists"
        )

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (returns the prompt alone)")
        if self.max_tokens == 0 and self.min_tokens:
            raise ValueError("min_tokens: must be 0 when max_tokens is 0")
        return self

    def num_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, or with ``echo`` and ``logprobs`` enough top candidates for the
        echoed prompt's logprobs too (vLLM's rule)."""
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((k for k in wanted if k is not None), default=None)

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: each a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class FunctionDefinition(OpenAIModel):
    """A function the model may call: its name (not empty: a call to it could not be routed),
    what it does, its arguments' JSON Schema."""

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIModel):
    """One entry of ``tools``: an OpenAI function tool."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIModel):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""OpenAI's reasoning effort values."""


class FunctionCall(OpenAIModel):
    """A call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(OpenAIModel):
    """A tool call in a message (ids like ``chatcmpl-tool-<hex>`` when the server makes them)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    """A piece of a streamed tool call: ``index`` numbers the calls of one choice; the first
    piece of a call carries its ``id``, ``type`` and function name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # An assistant's earlier calls and, in a "tool" message, the call it answers.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # vLLM's: an earlier assistant turn's reasoning, for templates that render it
    # (``reasoning_content``: its older name).
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content_parts(cls, content: Any) -> Any:
        # Name the unsupported part (image_url, input_audio, file, ...) instead of pydantic's
        # "Input should be a valid string" from the union's first member.
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(
                    f"Content part type {kind!r} is not supported: only 'text' parts are"
                )
            if kind == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} needs a string 'text'")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return TEXT_PART_SEPARATOR.join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_ThinkingBudgetFields):
    """``POST /v1/chat/completions``; the prompt is the model's chat template over ``messages``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: a Jinja template for this request only (needs --trust-request-chat-template);
    # chat_template_kwargs["chat_template"] is read as the same, and wins (as in vLLM).
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    # None with tools means "auto", as OpenAI and vLLM default (set by _check_tools).
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: with a --reasoning-parser, false leaves the reasoning out of the response.
    include_reasoning: bool = True
    # OpenAI's: reaches the chat template as `reasoning_effort`, and as vLLM passes it, turns
    # thinking on (`enable_thinking`, unless chat_template_kwargs sets it) unless "none".
    reasoning_effort: ReasoningEffort | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_legacy_functions(cls, data: Any) -> Any:
        # OpenAI's deprecated function calling: ignoring it would answer without the call.
        for legacy in ("functions", "function_call"):
            if isinstance(data, dict) and data.get(legacy) is not None:
                raise ValueError(
                    f"{legacy}: OpenAI's deprecated function calling (functions, function_call) "
                    "is not supported; use tools and tool_choice instead"
                )
        return data

    @model_validator(mode="after")
    def _read_template_from_kwargs(self) -> ChatCompletionRequest:
        template = (self.chat_template_kwargs or {}).pop("chat_template", None)
        if template is not None and not isinstance(template, str):
            raise ValueError("chat_template_kwargs: chat_template must be a string")
        if template is not None:
            self.chat_template = template
        return self

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tool_shapes(cls, tools: Any) -> Any:
        # The offline LLM.chat's checks: one clear message naming the tool at fault.
        if tools is not None:
            parse_chat_tools(tools)
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice_shape(cls, choice: Any) -> Any:
        # One clear message instead of pydantic's errors for each member of the union.
        function = choice.get("function") if isinstance(choice, dict) else None
        if choice in (None, "none", "auto", "required") or (
            isinstance(function, dict) and isinstance(function.get("name"), str)
        ):
            return choice
        raise ValueError(
            "tool_choice: must be 'none', 'auto', 'required' or "
            f'{{"type": "function", "function": {{"name": ...}}}}; got {choice!r}'
        )

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or []]
        for tool in self.tools or []:
            name = tool.function.name
            if tool.function.parameters is not None:
                try:
                    check_json_schema(tool.function.parameters)
                except ValueError as exc:
                    raise ValueError(
                        f"tools: the parameters of function {name!r} are not a valid JSON "
                        f"Schema: {exc}"
                    ) from None
        if self.tool_choice is None and self.tools:
            self.tool_choice = "auto"
        choice = self.tool_choice
        if choice in (None, "none"):
            return self
        named = self.tool_choice_function_name
        label = repr(choice) if named is None else f"function {named!r}"
        if not self.tools:
            raise ValueError(f"tool_choice: {label} needs tools; send tools or tool_choice 'none'")
        if named is not None and named not in names:
            raise ValueError(f"tool_choice: {label} is not among tools ({', '.join(names)})")
        if choice != "auto" and self.structured_outputs_params() is not None:
            raise ValueError(
                f"tool_choice: {label} constrains the output; it cannot be combined with "
                "response_format or structured_outputs"
            )
        return self

    @property
    def tool_choice_function_name(self) -> str | None:
        """The function ``tool_choice`` names, or None for a string ``tool_choice``."""
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam):
            return self.tool_choice.function.name
        return None

    @property
    def structured_outputs_param(self) -> str:
        """``tools`` when ``tool_choice`` constrains the output to the tools' parameters."""
        if self.tool_choice == "required" or self.tool_choice_function_name is not None:
            return "tools"
        return super().structured_outputs_param

    @model_validator(mode="after")
    def _check_tool_messages(self) -> ChatCompletionRequest:
        # OpenAI's rule: a tool result names the call it answers.
        for index, message in enumerate(self.messages):
            if message.role == "tool" and not message.tool_call_id:
                raise ValueError(
                    f"messages: messages[{index}].tool_call_id is required: a 'tool' message "
                    "answers the tool call with that id"
                )
        return self

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt"
            )
        return self

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class PromptTokenUsageInfo(OpenAIModel):
    """vLLM's ``usage.prompt_tokens_details`` (``--enable-prompt-tokens-details``):
    ``cached_tokens``, the prompt tokens read from the prefix cache; on chat completions also
    ``created_cache_tokens``, the prompt tokens this request computed into full cache blocks
    (None on completions, as vLLM); ``multimodal_tokens`` is always None here (text only)."""

    cached_tokens: int | None = None
    created_cache_tokens: int | None = None
    multimodal_tokens: dict[str, int] | None = None


class UsageInfo(OpenAIModel):
    """A response's token counts; ``prompt_tokens_details`` is left out of the JSON unless the
    server reports it (``--enable-prompt-tokens-details``), ``completion_tokens_details``
    (``{"reasoning_tokens": n}``) unless the server has a ``--reasoning-parser``, as vLLM's."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = Field(
        default=None, exclude_if=lambda details: details is None
    )
    completion_tokens_details: dict[str, int] | None = Field(
        default=None, exclude_if=lambda details: details is None
    )


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


PromptLogprobs = list[dict[int, Logprob] | None]
"""vLLM's ``prompt_logprobs`` in a response: None for the first prompt token, then for each
token ``{token_id: {logprob, rank, decoded_token}}`` (its top candidates and itself)."""


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's, with return_token_ids: the prompt's (a stream's first chunk of the choice) and
    # the output's (a stream's: those since the last chunk).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    """A chat reply; ``reasoning`` is vLLM's field for the text a ``--reasoning-parser`` found
    before the answer (``reasoning_parsers``)."""

    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    # vLLM's: the prompt's (one for all choices), not in a choice as completions have it.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class DeltaMessage(OpenAIModel):
    """A streamed piece of a chat reply: ``content``, vLLM's ``reasoning`` and/or
    ``tool_calls`` pieces (the first chunk of a choice carries its ``role``)."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: those since the last chunk


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: on the first chunks


class ModelCard(OpenAIModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvpilot"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIModel):
    """``/v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    """``/v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(OpenAIModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(OpenAIModel):
    """``POST /tokenize`` of a text (vLLM's body): its prompt token ids."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """``POST /tokenize`` of a conversation (vLLM's body): the prompt token ids a chat
    completion with the same ``messages``, template settings and ``tools`` would get. Its
    sampling fields are accepted and unused; ``add_special_tokens`` too (the chat template
    writes the special tokens it wants)."""

    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    """``count`` prompt tokens ``tokens`` (ids), the context they go into, and each token's
    string when asked for (``return_token_strs``)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    """``POST /detokenize`` (vLLM's body): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
