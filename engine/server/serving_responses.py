"""``POST /v1/responses`` (OpenAI's Responses API) on the chat path, and the store behind
``previous_response_id``, ``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``.

A request becomes a chat completion (``ResponsesRequest.to_chat_request``) that
``OpenAIServingChat.start`` renders and submits; its output is read by the same reasoning and
tool parsers and written as output items (``responses_items``), whole or as streaming events
(``responses_stream``). As in vLLM, responses are kept only when the server has a store
(``--enable-responses-store``, or vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE=1``); without one a
request's ``store`` is ignored and ``previous_response_id`` is not found.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from kvpilot.engine.async_llm import EngineError
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.server.errors import OpenAIError, bad_request, renamed, request_error
from kvpilot.engine.server.protocol import ChatCompletionRequest, DeltaMessage
from kvpilot.engine.server.responses_items import input_messages, output_items
from kvpilot.engine.server.responses_items import output_messages as reply_messages
from kvpilot.engine.server.responses_protocol import (
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from kvpilot.engine.server.responses_stream import ResponseEvents
from kvpilot.engine.server.serving_chat import ChatRun, OpenAIServingChat
from kvpilot.engine.server.serving_engine import engine_error_status

MAX_STORED_RESPONSES = 1024
"""Responses a store keeps; the oldest is dropped for a new one."""


@dataclass
class StoredResponse:
    """A kept response and the conversation a follow-up continues (its input and its reply)."""

    response: ResponsesResponse
    messages: list[dict[str, Any]]


class ResponseStore:
    """The responses a server keeps, in memory, the ``MAX_STORED_RESPONSES`` newest."""

    def __init__(self, max_size: int = MAX_STORED_RESPONSES) -> None:
        self.max_size = max_size
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        """Keep a response (the oldest is dropped past ``max_size``)."""
        self._responses[stored.response.id] = stored
        while len(self._responses) > self.max_size:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The kept response of that id, or None."""
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was kept."""
        return self._responses.pop(response_id, None) is not None


class OpenAIServingResponses:
    """Handles ``/v1/responses``.

    Args:
        chat: the server's chat handler (template, parsers, engine).
        store: where responses are kept; None: nowhere (``store`` is ignored).
    """

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store

    async def create_response(
        self, request: ResponsesRequest, arrival_time: float
    ) -> ResponsesResponse | AsyncIterator[str]:
        """Generate a response.

        Returns:
            The response, or for ``stream=true`` an iterator of its Server-Sent Events.

        Raises:
            OpenAIError: 404 for an unknown model or ``previous_response_id``; 400 for input,
                tools or settings the chat path refuses (named by this API's fields); 503
                when the waiting queue is full.
        """
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            history = self.retrieve_stored(request.previous_response_id).messages
        try:
            messages = input_messages(request.instructions, request.input, history)
            chat_request = request.to_chat_request(messages)
            run = await self.chat.start(chat_request, arrival_time)
        except ValueError as exc:  # the input's, or the chat request's checks
            raise responses_error(request_error(exc)) from None
        except OpenAIError as exc:
            raise responses_error(exc) from None
        response = ResponsesResponse.of(
            request,
            request.request_id or f"resp_{run.request_id.removeprefix('chatcmpl-')}",
            self.chat.response_model(run.lora_request),
            status="in_progress",
            store=self._stores(request),
            temperature=run.params.temperature,
            top_p=run.params.top_p,
        )
        if request.stream:
            return self._stream(request, chat_request, run, response, messages)
        try:
            final = await self.chat.final_output(run.stream)
        finally:
            run.stream.close()
        seq = final.outputs[0]
        reasoning, content, tool_calls, _ = run.parsers.choice().whole(seq.text, seq.finish_reason)
        reasoning_tokens = await run.reasoning_tokens(self.chat, [seq.token_ids])
        logprobs = None
        if not run.parsers.hides_tokens and chat_request.logprobs:
            # The text's own tokens: those after the reasoning.
            chunk = self.chat.logprobs_of(seq, reasoning_tokens or 0, chat_request)
            logprobs = [lp.model_dump() for lp in chunk.content or []]
        cut = seq.finish_reason == "length"
        items = output_items(reasoning, content, tool_calls, logprobs, cut)
        return await self._finish(request, response, run, final, items, messages, reasoning_tokens)

    def retrieve_stored(self, response_id: str) -> StoredResponse:
        """A kept response.

        Raises:
            OpenAIError: 404 (vLLM's message) when it is not kept, or the server keeps none.
        """
        stored = self.store.get(response_id) if self.store is not None else None
        if stored is None:
            raise OpenAIError(
                HTTPStatus.NOT_FOUND, f"Response with id '{response_id}' not found.", "response_id"
            )
        return stored

    def delete(self, response_id: str) -> dict[str, Any]:
        """Forget a kept response (OpenAI's ``DELETE /v1/responses/{id}`` body).

        Raises:
            OpenAIError: 404 when it is not kept.
        """
        self.retrieve_stored(response_id)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def cancel(self, response_id: str) -> ResponsesResponse:
        """vLLM's answer for a response that is not a background one (none is here).

        Raises:
            OpenAIError: 404 when it is not kept, else 400.
        """
        self.retrieve_stored(response_id)
        raise bad_request("Cannot cancel a synchronous response.", "response_id")

    def _stores(self, request: ResponsesRequest) -> bool:
        return request.store and self.store is not None

    async def _finish(
        self,
        request: ResponsesRequest,
        response: ResponsesResponse,
        run: ChatRun,
        final: RequestOutput,
        items: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        reasoning_tokens: int | None = None,
    ) -> ResponsesResponse:
        """The whole response from the request's last output and its items (its reasoning
        tokens counted unless given); kept when asked."""
        seq = final.outputs[0]
        if reasoning_tokens is None:
            reasoning_tokens = await run.reasoning_tokens(self.chat, [seq.token_ids])
        num_prompt_tokens = len(run.prompt_token_ids)
        num_output_tokens = len(seq.token_ids)
        cut = seq.finish_reason == "length"
        response = response.model_copy(
            update={
                "status": "incomplete" if cut else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "output": items,
                "usage": ResponseUsage(
                    input_tokens=num_prompt_tokens,
                    input_tokens_details={
                        "cached_tokens": final.num_cached_tokens,
                        "cache_write_tokens": self.chat.created_cache_tokens(
                            num_prompt_tokens, final.num_cached_tokens
                        ),
                    },
                    output_tokens=num_output_tokens,
                    output_tokens_details={"reasoning_tokens": reasoning_tokens or 0},
                    total_tokens=num_prompt_tokens + num_output_tokens,
                ),
            }
        )
        if self._stores(request):
            self.store.put(StoredResponse(response, messages + reply_messages(items)))
        if self.chat.log_outputs:
            self.chat.log_output(run.request_id, seq.text, seq.token_ids, seq.finish_reason)
        return response

    async def _stream(
        self,
        request: ResponsesRequest,
        chat_request: ChatCompletionRequest,
        run: ChatRun,
        response: ResponsesResponse,
        messages: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        events = ResponseEvents()
        parser = run.parsers.choice()
        wants_logprobs = chat_request.logprobs and not run.parsers.hides_tokens
        # Where the text's tokens start: after the reasoning's, known once the text begins.
        text_start = 0 if run.parsers.make_reasoning_parser is None else None
        sent_text = sent_logprobs = 0
        final = final_reason = None
        for event in events.start(response):
            yield event
        try:
            async for output in run.stream:
                final = output
                seq = output.outputs[0]
                final_reason = seq.finish_reason
                text, sent_text = seq.text[sent_text:], len(seq.text)
                delta = parser.delta(text, seq.finish_reason is not None)
                if text_start is None and delta is not None and delta.content:
                    text_start = await run.reasoning_tokens(self.chat, [seq.token_ids])
                logprobs = []
                if wants_logprobs and text_start is not None:
                    start = max(sent_logprobs, text_start)
                    chunk = self.chat.logprobs_of(seq, start, chat_request)
                    logprobs = [lp.model_dump() for lp in chunk.content or []] if chunk else []
                    sent_logprobs = len(seq.token_ids)
                if delta is not None or logprobs:
                    for event in events.delta(delta or DeltaMessage(), logprobs):
                        yield event
            for event in events.close("incomplete" if final_reason == "length" else "completed"):
                yield event
            yield events.completed(  # text_start, when known, is the reasoning's length
                await self._finish(
                    request, response, run, final, events.items, messages, text_start
                )
            )
        except EngineError as exc:
            yield events.error(str(exc), int(engine_error_status(exc)))
        finally:
            run.stream.close()


CHAT_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}
"""Chat completions' parameter names in errors -> the Responses API's."""


def responses_error(error: OpenAIError) -> OpenAIError:
    """An error of the chat path named by this API's fields (``CHAT_NAMES``): ``input`` for
    the messages, ``max_output_tokens``, ``text``. Errors about ``tools`` and ``tool_choice``
    keep their text, which quotes the request's own function names."""
    return renamed(error, CHAT_NAMES, keep=("tools", "tool_choice"))
