"""``POST /v1/chat/completions``: messages through the model's chat template, streamed or not,
with reasoning (``reasoning_parsers``) and tool calling (``tool_parsers``)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.async_llm import EngineError
from kvpilot.engine.chat_content_format import resolve_content_format
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import CompletionOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.output_parsers import OutputParsers
from kvpilot.engine.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from kvpilot.engine.server.reasoning_parsers import get_reasoning_parser
from kvpilot.engine.server.serving_engine import (
    OpenAIServing,
    RequestStream,
    clamp_logprob,
    new_request_id,
    response_id,
    sse,
    sse_error,
)
from kvpilot.engine.server.tool_parsers import get_tool_parser
from kvpilot.engine.tokenization import (
    NOT_TEMPLATE_VARIABLES,
    merge_chat_template_kwargs,
    parse_chat_messages,
    with_reasoning_effort,
)

ASSISTANT = "assistant"


@dataclass
class ChatRun:
    """A chat request submitted to the engine: what answering it needs.

    Attributes:
        request_id: the engine's id of the request.
        shown_id: the response's ``id`` (``response_id``).
        prompt_token_ids: the rendered prompt.
        stream: the engine's outputs (close it to abort the request).
        echo: vLLM's ``echo`` text put before the reply.
        lora_request: the adapter that serves it, or None.
        parsers: how its outputs are read (reasoning, tool calls).
        params: its sampling, as submitted.
    """

    request_id: str
    shown_id: str
    prompt_token_ids: list[int]
    stream: RequestStream
    echo: str
    lora_request: LoRARequest | None
    parsers: OutputParsers
    params: SamplingParams

    async def reasoning_tokens(
        self, serving: OpenAIServing, outputs: list[list[int]]
    ) -> int | None:
        """The reasoning tokens of its whole outputs (``OpenAIServing.reasoning_tokens``)."""
        return await serving.reasoning_tokens(
            self.parsers.make_reasoning_parser, outputs, self.params
        )


logger = logging.getLogger("kvpilot.server")


class OpenAIServingChat(OpenAIServing):
    """Handles chat completions: the model's chat template renders the prompt
    (``tokenization.apply_chat_template``, on the tokenizer thread), as vLLM does.

    The server's ``--chat-template`` is the tokenizer's own template by then (``app.py``
    installs it on the server's tokenizer); a request's ``chat_template`` replaces it for that
    request when the server trusts request templates.

    Args:
        *args: as ``OpenAIServing``.
        auto_tool_parser: the ``TOOL_PARSERS`` name that reads ``tool_choice`` ``"auto"``
            outputs (``--tool-call-parser`` with ``--enable-auto-tool-choice``); None refuses
            ``"auto"``.
        reasoning_parser: the ``REASONING_PARSERS`` name that splits every output into
            reasoning and content (``--reasoning-parser``); None: all content.
        trust_request_chat_template: render with a request's ``chat_template`` (vLLM's
            ``--trust-request-chat-template``); False refuses such requests.
        response_role: the role of replies (vLLM's ``--response-role``).
        chat_template: the server's template (``--chat-template``, else the model's; a dict of
            named templates, or None), read to resolve ``content_format``.
        content_format: how message content reaches the template (vLLM's
            ``--chat-template-content-format``): ``"string"``, ``"openai"`` or ``"auto"``
            (``chat_content_format.resolve_content_format``, for the template that renders).
        default_chat_template_kwargs: template variables of every request, under its own
            ``chat_template_kwargs`` (vLLM's ``--default-chat-template-kwargs``).
        exclude_tools_when_tool_choice_none: render a ``tool_choice: "none"`` request without
            its tools (vLLM's ``--exclude-tools-when-tool-choice-none``).
    """

    def __init__(
        self,
        *args: Any,
        auto_tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        trust_request_chat_template: bool = False,
        response_role: str = ASSISTANT,
        chat_template: str | dict[str, str] | None = None,
        content_format: str = "auto",
        default_chat_template_kwargs: dict[str, Any] | None = None,
        exclude_tools_when_tool_choice_none: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.response_role = response_role
        self.auto_tool_parser = auto_tool_parser
        self.reasoning_parser = reasoning_parser
        self.trust_request_chat_template = trust_request_chat_template
        self.chat_template = chat_template
        self.content_format = content_format
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self._logged_formats: set[str] = set()

    async def create_chat_completion(
        self, request: ChatCompletionRequest, arrival_time: float
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """Run a chat completion request.

        Returns:
            The response, or for ``stream=true`` an iterator of Server-Sent Events.

        Raises:
            OpenAIError: as ``start``.
        """
        run = await self.start(request, arrival_time)
        if request.stream:
            return self._stream(request, run)
        try:
            final = await self.final_output(run.stream)
        finally:
            run.stream.close()
        choices = [self._choice(request, seq, run.echo, run.parsers) for seq in final.outputs]
        num_prompt_tokens = len(run.prompt_token_ids)
        outputs = [seq.token_ids for seq in final.outputs]
        response = ChatCompletionResponse(
            id=run.shown_id,
            model=self.response_model(run.lora_request),
            choices=choices,
            usage=self.usage(
                num_prompt_tokens,
                sum(map(len, outputs)),
                self.prompt_tokens_details(final, num_prompt_tokens, True),
                await run.reasoning_tokens(self, outputs),
            ),
            prompt_logprobs=self.prompt_logprobs(request, run.prompt_token_ids, final),
            prompt_token_ids=run.prompt_token_ids if request.return_token_ids else None,
        )
        if self.log_outputs:
            for choice, seq in zip(choices, final.outputs, strict=True):
                self._log_choice(run.request_id, choice, seq.token_ids)
        return response

    async def start(self, request: ChatCompletionRequest, arrival_time: float) -> ChatRun:
        """Render, check and submit a chat request (``/v1/responses`` runs through it too).

        Raises:
            OpenAIError: 400 for invalid parameters or messages (including a template that
                refuses them, and ``chat_template_kwargs`` that are not template variables), a
                request ``chat_template`` the server does not trust or that fails to compile or
                render; 404 for an unknown model, 503 when the waiting queue is full.
        """
        lora_request = self.check_model(request.model)
        self._check_template_trusted(request)
        try:
            make_tool_parser = get_tool_parser(request, self.auto_tool_parser)
        except ValueError as exc:
            raise bad_request(exc, "tool_choice") from None
        template_args = self.template_arguments(request)
        prompt_token_ids = self.truncate_prompt(
            await self._render(request, template_args), request.truncate_prompt_tokens
        )
        max_tokens = self.max_tokens_for(
            len(prompt_token_ids), request.requested_max_tokens(), "messages"
        )
        params = self.sampling_params(request, max_tokens, request.num_logprobs())
        if make_tool_parser is not None:
            try:
                make_tool_parser().adjust_request(params)
            except ValueError as exc:
                raise bad_request(exc) from None
        parsers = OutputParsers(
            get_reasoning_parser(
                self.reasoning_parser, template_args["chat_template_kwargs"], params
            ),
            make_tool_parser,
            request.include_reasoning,
        )
        parsers.adjust_request(params)
        await self.compile_grammar(request, params)
        request_id = new_request_id("chatcmpl")
        prompt_text = None
        if self.logs_prompt_details:  # the rendered prompt, as vLLM logs it
            prompt_text = await self.tokenizer.decode(prompt_token_ids)
        stream = await self.add(
            request_id,
            prompt_token_ids,
            params,
            arrival_time,
            request.cache_salt,
            lora_request,
            prompt_text=prompt_text,
            priority=request.priority,
        )
        return ChatRun(
            request_id=request_id,
            shown_id=response_id("chatcmpl", request_id, request.request_id),
            prompt_token_ids=prompt_token_ids,
            stream=stream,
            echo=self._echo_text(request, template_args["add_generation_prompt"]),
            lora_request=lora_request,
            parsers=parsers,
            params=params,
        )

    def _log_choice(
        self, request_id: str, choice: ChatCompletionChoice, token_ids: list[int]
    ) -> None:
        """Log a finished reply as vLLM does: its content, else its tool calls as
        ``[tool_calls: name(arguments), ...]``; nothing for an empty one."""
        text = choice.message.content or ""
        if not text and choice.message.tool_calls:
            calls = ", ".join(
                f"{call.function.name}({call.function.arguments})"
                for call in choice.message.tool_calls
            )
            text = f"[tool_calls: {calls}]"
        if text:
            self.log_output(request_id, text, token_ids, choice.finish_reason)

    def _choice(
        self,
        request: ChatCompletionRequest,
        seq: CompletionOutput,
        echo: str,
        parsers: OutputParsers,
    ) -> ChatCompletionChoice:
        reasoning, content, tool_calls, finish_reason = parsers.choice().whole(
            seq.text, seq.finish_reason
        )
        hidden = parsers.hides_tokens
        return ChatCompletionChoice(
            index=seq.index,
            message=ChatResponseMessage(
                role=self.response_role,
                content=echo + content if content is not None else echo or None,
                reasoning=reasoning,
                tool_calls=tool_calls,
            ),
            logprobs=None if hidden else self.logprobs_of(seq, 0, request),
            finish_reason=finish_reason,
            stop_reason=seq.stop_reason,
            **({} if hidden else self.token_ids(request, None, seq.token_ids)),
        )

    def _log_delta(
        self,
        request_id: str,
        delta: DeltaMessage,
        token_ids: list[int],
        finish_reason: str | None,
    ) -> None:
        """Log a streamed delta as vLLM does: its content, ``[reasoning: ...]`` and
        ``[tool_calls: <arguments>]``, joined by spaces; nothing for a delta without them."""
        parts = [delta.content] if delta.content else []
        if delta.reasoning:
            parts.append(f"[reasoning: {delta.reasoning}]")
        arguments = "".join(
            call.function.arguments
            for call in delta.tool_calls or []
            if call.function and call.function.arguments
        )
        if arguments:
            parts.append(f"[tool_calls: {arguments}]")
        if parts:
            self.log_output(
                request_id, " ".join(parts), token_ids, finish_reason, streaming=True, delta=True
            )

    def _check_template_trusted(self, request: ChatCompletionRequest) -> None:
        if request.chat_template is not None and not self.trust_request_chat_template:
            # vLLM's wording.
            raise bad_request(
                "Chat template is passed with request, but --trust-request-chat-template is "
                "not set. Refused request with untrusted chat template.",
                "chat_template",
            )

    async def render(self, request: ChatCompletionRequest) -> list[int]:
        """The prompt token ids of ``request``'s conversation, as a chat completion renders it
        (``/tokenize`` of messages).

        Raises:
            OpenAIError: 400 for a request ``chat_template`` the server does not trust, or
                messages or ``chat_template_kwargs`` the template refuses.
        """
        self._check_template_trusted(request)
        return await self._render(request, self.template_arguments(request))

    def template_arguments(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """``chat_template_arguments`` with this server's defaults and tool settings.

        Raises:
            OpenAIError: 400 naming ``chat_template_kwargs`` (see ``chat_template_arguments``).
        """
        return chat_template_arguments(
            request,
            self.default_chat_template_kwargs,
            self.exclude_tools_when_tool_choice_none,
        )

    def resolve_content_format(self, template_args: dict[str, Any]) -> str:
        """``"string"`` or ``"openai"``: how the conversation reaches the template that will
        render it (the request's, else the server's), as vLLM resolves
        ``--chat-template-content-format``."""
        template = template_args["chat_template"] or self.chat_template
        resolved = resolve_content_format(
            self.content_format, template, bool(template_args["tools"])
        )
        if self.content_format == "auto" and resolved not in self._logged_formats:
            self._logged_formats.add(resolved)
            logger.info(
                "Detected the chat template content format to be '%s'. You can set "
                "--chat-template-content-format to override this.",
                resolved,
            )
        return resolved

    async def _render(
        self, request: ChatCompletionRequest, template_args: dict[str, Any]
    ) -> list[int]:
        try:
            conversation = parse_chat_messages(
                [message.model_dump(exclude_none=True) for message in request.messages],
                self.resolve_content_format(template_args),
            )
            return await self.tokenizer.apply_chat_template(conversation, **template_args)
        except ValueError as exc:
            raise bad_request(exc) from None

    def _echo_text(self, request: ChatCompletionRequest, add_generation_prompt: bool) -> str:
        """vLLM's chat ``echo``: the last message's content when it has the reply's role (the
        response role when the prompt ends with the generation prompt)."""
        if not request.echo:
            return ""
        last = request.messages[-1]
        role = self.response_role if add_generation_prompt else last.role
        return last.text() if last.role == role else ""

    def logprobs_of(
        self, seq: CompletionOutput, start: int, request: ChatCompletionRequest
    ) -> ChatChoiceLogprobs | None:
        """The ``logprobs`` of ``seq``'s tokens from ``start`` on; None unless asked for."""
        if seq.logprobs is None:
            return None
        as_id = request.return_tokens_as_token_ids or self.return_tokens_as_token_ids
        content = []
        for token_id, candidates in zip(seq.token_ids[start:], seq.logprobs[start:], strict=False):
            sampled = candidates.get(token_id)
            text = self.token_text(token_id, sampled, as_id)
            ranked = sorted(candidates.items(), key=lambda item: item[1].rank or 0)
            top = [
                TopLogprob(
                    token=(top_text := self.token_text(t, lp, as_id)),
                    logprob=clamp_logprob(lp.logprob),
                    bytes=list(top_text.encode()),
                )
                for t, lp in ranked[: request.top_logprobs or 0]
            ]
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=clamp_logprob(sampled.logprob if sampled else float("-inf")),
                    bytes=list(text.encode()),
                    top_logprobs=top,
                )
            )
        return ChatChoiceLogprobs(content=content)

    async def _stream(self, request: ChatCompletionRequest, run: ChatRun) -> AsyncIterator[str]:
        request_id, engine_request_id = run.shown_id, run.request_id
        prompt_token_ids, stream, parsers = run.prompt_token_ids, run.stream, run.parsers
        echo, lora_request = run.echo, run.lora_request
        model = self.response_model(lora_request)
        num_prompt_tokens = len(prompt_token_ids)
        n = request.n
        num_tokens = [0] * n
        include_usage, every = self.stream_usage(request)
        first_output = None  # vLLM's cached tokens: the first output's
        texts = [""] * n  # each choice's generated text, for the log
        outputs: list[list[int]] = [[] for _ in range(n)]  # each choice's token ids
        created = int(time.time())  # one timestamp for every chunk, as OpenAI's and vLLM's

        def chunk(choices: list[ChatCompletionStreamChoice], first: bool = False) -> str:
            usage = self.usage(num_prompt_tokens, sum(num_tokens)) if every else None
            shown = prompt_token_ids if first and request.return_token_ids else None
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=choices,
                    usage=usage,
                    prompt_token_ids=shown,
                )
            )

        for index in range(n):
            # The first chunk of each choice carries the role, as OpenAI's does (and, with
            # return_token_ids, the prompt's token ids, as vLLM's).
            delta = DeltaMessage(role=self.response_role, content=echo)
            yield chunk([ChatCompletionStreamChoice(index=index, delta=delta)], first=True)
        sent_text = [0] * n
        sent_tokens = [0] * n
        finished = [False] * n
        choice_parsers = [parsers.choice() for _ in range(n)]
        try:
            async for output in stream:
                first_output = first_output or output
                for seq in output.outputs:
                    index = seq.index
                    num_tokens[index] = len(seq.token_ids)
                    outputs[index] = seq.token_ids
                    if finished[index]:
                        continue
                    text = seq.text[sent_text[index] :]
                    sent_text[index] = len(seq.text)
                    texts[index] = seq.text
                    finished[index] = seq.finish_reason is not None
                    parser = choice_parsers[index]
                    delta = parser.delta(text, finished[index])
                    finish_reason = parser.finish_reason(seq.finish_reason)
                    logprobs = None
                    if not parsers.hides_tokens:
                        logprobs = self.logprobs_of(seq, sent_tokens[index], request)
                    has_logprobs = logprobs is not None and bool(logprobs.content)
                    if delta is None and not has_logprobs and not finished[index]:
                        continue
                    if self.log_outputs and self.log_deltas and delta is not None:
                        self._log_delta(
                            engine_request_id,
                            delta,
                            seq.token_ids[sent_tokens[index] :],
                            seq.finish_reason,
                        )
                    ids = {}
                    if not parsers.hides_tokens:
                        ids = self.token_ids(request, None, seq.token_ids[sent_tokens[index] :])
                    sent_tokens[index] = len(seq.token_ids)
                    choice = ChatCompletionStreamChoice(
                        index=index,
                        delta=delta or DeltaMessage(),
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=seq.stop_reason,
                        **ids,
                    )
                    yield chunk([choice])
            if include_usage:
                details = self.prompt_tokens_details(first_output, num_prompt_tokens, True)
                reasoning = await run.reasoning_tokens(self, outputs)
                usage = self.usage(num_prompt_tokens, sum(num_tokens), details, reasoning)
                response = ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                )
                yield sse(response, exclude_none=True)  # as vLLM sends it
            if self.log_outputs:
                for text in texts:
                    self.log_output(
                        engine_request_id, text, None, "streaming_complete", streaming=True
                    )
        except EngineError as exc:
            yield sse_error(exc)
        finally:
            stream.close()
        yield sse("[DONE]")


def chat_template_arguments(
    request: ChatCompletionRequest,
    default_kwargs: Mapping[str, Any] | None = None,
    exclude_tools_when_tool_choice_none: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of ``tokenization.apply_chat_template`` for a request, merged as
    vLLM merges them (``tokenization.merge_chat_template_kwargs``): ``chat_template_kwargs`` over
    the request's own settings; a ``reasoning_effort`` is the template variable of that name and
    sets ``enable_thinking`` (false for ``"none"``) where ``chat_template_kwargs`` does not.

    Args:
        request: the chat request.
        default_kwargs: the server's ``--default-chat-template-kwargs``, checked at start
            (``check_default_chat_template_kwargs``): under the request's
            ``chat_template_kwargs``, key by key; a request key whose value is null or
            ``"auto"`` leaves the default (vLLM's ``merge_kwargs``).
        exclude_tools_when_tool_choice_none: no tools for a ``tool_choice: "none"`` request.

    Raises:
        OpenAIError: 400 naming ``chat_template_kwargs`` for a key that is not a template
            variable (``tokenization.NOT_TEMPLATE_VARIABLES``).
    """
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    if exclude_tools_when_tool_choice_none and request.tool_choice == "none":
        tools = []
    variables = with_reasoning_effort(request.reasoning_effort, request.chat_template_kwargs)
    if default_kwargs:
        own = {k: v for k, v in (variables or {}).items() if v is not None and v != "auto"}
        variables = dict(default_kwargs) | own
    try:
        return merge_chat_template_kwargs(
            tools=tools or None,
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=variables,
        )
    except ValueError as exc:
        raise bad_request(exc, "chat_template_kwargs") from None


IGNORED_DEFAULT_KWARGS = ("add_generation_prompt", "continue_final_message")
"""``--default-chat-template-kwargs`` keys that change nothing: every request sets these
fields (defaults included), and vLLM lets the request's value win."""
REFUSED_DEFAULT_KWARGS = frozenset({"chat_template", "tools"}) | NOT_TEMPLATE_VARIABLES
"""``--default-chat-template-kwargs`` keys refused at start: vLLM would fail every request on
them (the template and the tools come from elsewhere; the rest are not template variables)."""


def check_default_chat_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The server's ``--default-chat-template-kwargs``, as requests merge them.

    Returns:
        The variables, without ``IGNORED_DEFAULT_KWARGS`` (logged as ignored).

    Raises:
        ValueError: ``"--default-chat-template-kwargs: ..."`` naming the keys of
            ``REFUSED_DEFAULT_KWARGS`` given.
    """
    kwargs = dict(kwargs or {})
    if refused := sorted(REFUSED_DEFAULT_KWARGS & kwargs.keys()):
        raise ValueError(
            f"--default-chat-template-kwargs: {', '.join(map(repr, refused))} cannot be set "
            "here: only template variables (such as enable_thinking) may be given; the chat "
            "template comes from --chat-template or the model, the tools from each request"
        )
    for key in IGNORED_DEFAULT_KWARGS:
        if kwargs.pop(key, None) is not None:
            logger.warning(
                "--default-chat-template-kwargs: %r is ignored: each request's own %s wins, "
                "as in vLLM",
                key,
                key,
            )
    return kwargs
