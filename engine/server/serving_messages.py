"""``POST /v1/messages`` (Anthropic's Messages API) and ``/v1/messages/count_tokens`` on the chat
path, as vLLM serves them.

A request becomes a chat completion (``MessagesRequest.to_chat_request``) that
``OpenAIServingChat.start`` renders and submits; its output is read by the same reasoning and
tool parsers and written as content blocks (``thinking``, ``text``, ``tool_use``), whole or as
streaming events (``anthropic_stream``). Errors are raised as ``OpenAIError``; the route writes
them in Anthropic's body (``anthropic_protocol.error_body``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from kvpilot.engine.async_llm import EngineError
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.server.anthropic_protocol import (
    CHAT_NAMES,
    CountTokensRequest,
    MessagesRequest,
    MessagesResponse,
    error_body,
    stop_reason,
    tool_input,
)
from kvpilot.engine.server.anthropic_stream import MessageEvents
from kvpilot.engine.server.errors import OpenAIError, renamed, request_error
from kvpilot.engine.server.protocol import ChatCompletionRequest, ToolCall
from kvpilot.engine.server.serving_chat import ChatRun, OpenAIServingChat
from kvpilot.engine.server.serving_engine import engine_error_status


class AnthropicServingMessages:
    """Handles ``/v1/messages``.

    Args:
        chat: the server's chat handler (template, parsers, engine).
    """

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(
        self, request: MessagesRequest, arrival_time: float
    ) -> MessagesResponse | AsyncIterator[str]:
        """Generate a reply.

        Returns:
            The message, or for ``stream=true`` an iterator of its Server-Sent Events.

        Raises:
            OpenAIError: 404 for an unknown model; 400 for messages, tools or settings that
                cannot be read or that the chat path refuses; 503 when the waiting queue is
                full.
        """
        try:
            run = await self.chat.start(chat_request(request), arrival_time)
        except OpenAIError as exc:
            raise messages_error(exc) from None
        message_id = f"msg_{request.request_id or run.request_id.removeprefix('chatcmpl-')}"
        model = self.chat.response_model(run.lora_request)
        if request.stream:
            return self._stream(run, message_id, model)
        try:
            final = await self.chat.final_output(run.stream)
        finally:
            run.stream.close()
        seq = final.outputs[0]
        reasoning, content, tool_calls, finish = run.parsers.choice().whole(
            seq.text, seq.finish_reason
        )
        self._log_output(run, final)
        return MessagesResponse(
            id=message_id,
            model=model,
            content=content_blocks(reasoning, content, tool_calls),
            stop_reason=stop_reason(finish, seq.stop_reason, bool(tool_calls)),
            stop_sequence=_stop_sequence(finish, seq.stop_reason, bool(tool_calls)),
            usage=self._usage(run, final),
        )

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, int]:
        """``{"input_tokens": n}``: the prompt a messages request would have.

        Raises:
            OpenAIError: as ``create_message``.
        """
        self.chat.check_model(request.model)
        try:
            return {"input_tokens": len(await self.chat.render(chat_request(request)))}
        except OpenAIError as exc:
            raise messages_error(exc) from None

    def _usage(self, run: ChatRun, output: RequestOutput) -> dict[str, int]:
        """Anthropic's usage: ``input_tokens`` are the prompt's tokens neither read from the
        prefix cache (``cache_read_input_tokens``) nor added to it in full blocks
        (``cache_creation_input_tokens``); the three sum to the prompt, as Anthropic counts."""
        cached = output.num_cached_tokens
        num_prompt_tokens = len(run.prompt_token_ids)
        created = self.chat.created_cache_tokens(num_prompt_tokens, cached)
        return {
            "input_tokens": num_prompt_tokens - cached - created,
            "output_tokens": len(output.outputs[0].token_ids),
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": created,
        }

    def _log_output(self, run: ChatRun, final: RequestOutput, streaming: bool = False) -> None:
        """The reply's text in the log, with ``--enable-log-outputs``."""
        if self.chat.log_outputs:
            seq = final.outputs[0]
            self.chat.log_output(
                run.request_id, seq.text, seq.token_ids, seq.finish_reason, streaming=streaming
            )

    async def _stream(self, run: ChatRun, message_id: str, model: str) -> AsyncIterator[str]:
        events = MessageEvents()
        parser = run.parsers.choice()
        sent_text, called, final, finish = 0, False, None, None
        try:
            async for output in run.stream:
                if final is None:  # sent with the first output, which knows the cache hits
                    yield events.start(
                        {
                            "id": message_id,
                            "type": "message",
                            "role": "assistant",
                            "model": model,
                            "content": [],
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": self._usage(run, output) | {"output_tokens": 0},
                        }
                    )
                final, seq = output, output.outputs[0]
                text, sent_text = seq.text[sent_text:], len(seq.text)
                delta = parser.delta(text, seq.finish_reason is not None)
                finish = parser.finish_reason(seq.finish_reason)
                if delta is not None:
                    called = called or bool(delta.tool_calls)
                    for event in events.delta(delta):
                        yield event
            seq = final.outputs[0]
            for event in events.stop(
                stop_reason(finish, seq.stop_reason, called),
                _stop_sequence(finish, seq.stop_reason, called),
                self._usage(run, final),
            ):
                yield event
            self._log_output(run, final, streaming=True)
        except EngineError as exc:
            yield events.error(int(engine_error_status(exc)), str(exc))
        finally:
            run.stream.close()


def chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The request's chat completion.

    Raises:
        OpenAIError: 400 naming what cannot be read or what chat completions refuse.
    """
    try:
        return request.to_chat_request()
    except ValueError as exc:
        raise messages_error(request_error(exc)) from None


def messages_error(error: OpenAIError) -> OpenAIError:
    """An error of the chat path named by this API's fields (``anthropic_protocol.CHAT_NAMES``);
    errors about ``tools`` and ``tool_choice`` keep their text (it quotes the tools' names)."""
    return renamed(error, CHAT_NAMES, keep=("tools", "tool_choice"))


def content_blocks(
    reasoning: str | None, content: str | None, tool_calls: list[ToolCall] | None
) -> list[dict[str, Any]]:
    """A whole reply as content blocks: ``thinking``, ``text``, ``tool_use`` (each present)."""
    blocks: list[dict[str, Any]] = []
    if not reasoning and not content and not tool_calls:
        # An empty reply still has its text block, as vLLM sends it (clients read content[0]).
        return [{"type": "text", "text": ""}]
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    for call in tool_calls or ():
        blocks.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.function.name,
                "input": tool_input(call.function.arguments),
            }
        )
    return blocks


def _stop_sequence(finish: str | None, stop: int | str | None, tool_used: bool) -> str | None:
    """The stop string met, where it is the ``stop_reason``."""
    return stop if stop_reason(finish, stop, tool_used) == "stop_sequence" else None


def anthropic_error(error: OpenAIError) -> JSONResponse:
    """An error as Anthropic answers it (``anthropic_protocol.error_body``)."""
    status = int(error.status)
    return JSONResponse(error_body(status, error.message), status, headers=error.headers)
