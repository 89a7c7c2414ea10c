"""``POST /v1/chat/completions``: messages through the model's chat template, streamed or not,
with reasoning (``reasoning_parsers``) and tool calling (``tool_parsers``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.async_llm import EngineError
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import CompletionOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.errors import bad_request
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
    ToolCall,
    TopLogprob,
)
from kvpilot.engine.server.reasoning_parsers import ReasoningParser, get_reasoning_parser
from kvpilot.engine.server.serving_engine import (
    OpenAIServing,
    RequestStream,
    clamp_logprob,
    new_request_id,
    response_id,
    sse,
    sse_error,
)
from kvpilot.engine.server.tool_parsers import ToolParser, get_tool_parser
from kvpilot.engine.tokenization import merge_chat_template_kwargs, parse_chat_messages

ASSISTANT = "assistant"


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
    """

    def __init__(
        self,
        *args: Any,
        auto_tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        trust_request_chat_template: bool = False,
        response_role: str = ASSISTANT,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.response_role = response_role
        self.auto_tool_parser = auto_tool_parser
        self.reasoning_parser = reasoning_parser
        self.trust_request_chat_template = trust_request_chat_template

    async def create_chat_completion(
        self, request: ChatCompletionRequest, arrival_time: float
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """Run a chat completion request.

        Returns:
            The response, or for ``stream=true`` an iterator of Server-Sent Events.

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
        template_args = chat_template_arguments(request)
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
        stream = await self.add(
            request_id, prompt_token_ids, params, arrival_time, request.cache_salt, lora_request
        )
        echo = self._echo_text(request, template_args["add_generation_prompt"])
        shown_id = response_id("chatcmpl", request_id, request.request_id)
        if request.stream:
            return self._stream(
                request,
                shown_id,
                prompt_token_ids,
                stream,
                echo,
                lora_request,
                parsers,
            )
        try:
            final = await self.final_output(stream)
        finally:
            stream.close()
        choices = [self._choice(request, seq, echo, parsers) for seq in final.outputs]
        return ChatCompletionResponse(
            id=shown_id,
            model=self.response_model(lora_request),
            choices=choices,
            usage=self.usage(
                len(prompt_token_ids), sum(len(seq.token_ids) for seq in final.outputs)
            ),
            prompt_logprobs=self.prompt_logprobs(request, prompt_token_ids, final),
            prompt_token_ids=prompt_token_ids if request.return_token_ids else None,
        )

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
            logprobs=None if hidden else self._logprobs(seq, 0, request),
            finish_reason=finish_reason,
            stop_reason=seq.stop_reason,
            **({} if hidden else self.token_ids(request, None, seq.token_ids)),
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
        return await self._render(request, chat_template_arguments(request))

    async def _render(
        self, request: ChatCompletionRequest, template_args: dict[str, Any]
    ) -> list[int]:
        try:
            conversation = parse_chat_messages(
                [message.model_dump(exclude_none=True) for message in request.messages]
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

    def _logprobs(
        self, seq: CompletionOutput, start: int, request: ChatCompletionRequest
    ) -> ChatChoiceLogprobs | None:
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

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt_token_ids: list[int],
        stream: RequestStream,
        echo: str,
        lora_request: LoRARequest | None,
        parsers: OutputParsers,
    ) -> AsyncIterator[str]:
        model = self.response_model(lora_request)
        num_prompt_tokens = len(prompt_token_ids)
        n = request.n
        num_tokens = [0] * n
        every = request.stream_options is not None and request.stream_options.every_chunk()

        def chunk(choices: list[ChatCompletionStreamChoice], first: bool = False) -> str:
            usage = self.usage(num_prompt_tokens, sum(num_tokens)) if every else None
            shown = prompt_token_ids if first and request.return_token_ids else None
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id,
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
                for seq in output.outputs:
                    index = seq.index
                    num_tokens[index] = len(seq.token_ids)
                    if finished[index]:
                        continue
                    text = seq.text[sent_text[index] :]
                    sent_text[index] = len(seq.text)
                    finished[index] = seq.finish_reason is not None
                    parser = choice_parsers[index]
                    delta = parser.delta(text, finished[index])
                    finish_reason = parser.finish_reason(seq.finish_reason)
                    logprobs = None
                    if not parsers.hides_tokens:
                        logprobs = self._logprobs(seq, sent_tokens[index], request)
                    has_logprobs = logprobs is not None and bool(logprobs.content)
                    if delta is None and not has_logprobs and not finished[index]:
                        continue
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
            if request.stream_options and request.stream_options.include_usage:
                yield sse(
                    ChatCompletionStreamResponse(
                        id=request_id,
                        model=model,
                        choices=[],
                        usage=self.usage(num_prompt_tokens, sum(num_tokens)),
                    )
                )
        except EngineError as exc:
            yield sse_error(exc)
        finally:
            stream.close()
        yield sse("[DONE]")


def chat_template_arguments(request: ChatCompletionRequest) -> dict[str, Any]:
    """The keyword arguments of ``tokenization.apply_chat_template`` for a request, merged as
    vLLM merges them (``tokenization.merge_chat_template_kwargs``): ``chat_template_kwargs`` over
    the request's own settings.

    Raises:
        OpenAIError: 400 naming ``chat_template_kwargs`` for a key that is not a template
            variable (``tokenization.NOT_TEMPLATE_VARIABLES``).
    """
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    try:
        return merge_chat_template_kwargs(
            tools=tools or None,
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs,
        )
    except ValueError as exc:
        raise bad_request(exc, "chat_template_kwargs") from None


@dataclass
class OutputParsers:
    """How a request's outputs are read, as vLLM chains its parsers: the reasoning parser splits
    off the reasoning, then the tool parser reads the calls in the content that remains.

    Attributes:
        make_reasoning_parser: makes a choice's reasoning parser; None: no reasoning.
        make_tool_parser: makes a choice's tool parser; None: no tool calls.
        include_reasoning: the request's ``include_reasoning``.
    """

    make_reasoning_parser: Callable[[], ReasoningParser] | None
    make_tool_parser: Callable[[], ToolParser] | None
    include_reasoning: bool

    @property
    def hides_tokens(self) -> bool:
        """Whether logprobs and token ids stay out of the response: they would show the
        reasoning the request left out (vLLM's rule)."""
        return self.make_reasoning_parser is not None and not self.include_reasoning

    def adjust_request(self, params: SamplingParams) -> None:
        """The reasoning parser's changes to the request's sampling (the tool parser's are
        made before, where its errors become 400s)."""
        if self.make_reasoning_parser is not None:
            self.make_reasoning_parser().adjust_request(params)

    def choice(self) -> ChoiceParser:
        """Fresh parsers for one choice."""
        return ChoiceParser(
            self.make_reasoning_parser() if self.make_reasoning_parser else None,
            self.make_tool_parser() if self.make_tool_parser else None,
            self.include_reasoning,
        )


class ChoiceParser:
    """One choice's reasoning and tool parsers, fed its output whole or in deltas."""

    def __init__(
        self,
        reasoning_parser: ReasoningParser | None,
        tool_parser: ToolParser | None,
        include_reasoning: bool,
    ) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.include_reasoning = include_reasoning

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        """The delta to send for newly generated text (None: nothing yet)."""
        reasoning = None
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.extract_reasoning_streaming(text, finished)
            text = (split.content or "") if split else ""
            reasoning = split.reasoning if split and self.include_reasoning else None
        if self.tool_parser is not None:
            delta = self.tool_parser.extract_tool_calls_streaming(text, finished)
        else:
            delta = DeltaMessage(content=text) if text else None
        if reasoning:
            delta = (delta or DeltaMessage()).model_copy(update={"reasoning": reasoning})
        return delta

    def whole(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, str | None, list[ToolCall] | None, str | None]:
        """``(reasoning, content, tool_calls, finish_reason)`` of a whole output; the content
        is None when the output is all reasoning, or all calls."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning(text)
            reasoning = reasoning if self.include_reasoning else None
        tool_calls = None
        if self.tool_parser is not None and content is not None:
            extracted = self.tool_parser.extract_tool_calls(content)
            content, tool_calls = extracted.content, extracted.tool_calls or None
        return reasoning, content, tool_calls, self.finish_reason(finish_reason)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """``tool_calls`` for an output that ended normally after making calls."""
        if self.tool_parser is None:
            return finish_reason
        return self.tool_parser.finish_reason(finish_reason)
